"""StreamedFile: a torch.save archive written one tensor at a time reads back as torch.save's would."""

from __future__ import annotations

import os
import re
import zipfile
import zlib

import pytest
import torch

from lightning_shardrec.checkpoint import save_streamed, streamed_file, zip_crc
from lightning_shardrec.errors import CheckpointError


def _obj(put):
    torch.manual_seed(0)
    big, small = torch.randn(40, 8), torch.randn(3, 4)
    half = torch.randn(6, dtype=torch.float16)
    return {
        "state_dict": {"table": put(big), "row_state": put(torch.arange(40.0)[5:15]), "dense": small},
        "view_of_dense": small[1],  # shares the dense tensor's storage, as torch.save keeps it
        "fused": {"table": {"step": put(torch.tensor(7.0).reshape(())), "m": put(half)}},
        "meta": [1, "x", None],
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_streamed_file_loads_as_torch_save(tmp_path, mmap):
    save_streamed(tmp_path / "s.ckpt", lambda stream: _obj(stream.put))
    torch.save(_obj(lambda t: t), tmp_path / "t.ckpt")
    got = torch.load(tmp_path / "s.ckpt", weights_only=True, mmap=mmap)
    want = torch.load(tmp_path / "t.ckpt", weights_only=True)
    assert got.pop("meta") == want.pop("meta") == [1, "x", None]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dense, view = got["state_dict"]["dense"], got["view_of_dense"]
    assert view.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()


def test_a_failed_streamed_write_leaves_nothing(tmp_path):
    target = tmp_path / "c.ckpt"
    torch.save({"old": torch.ones(2)}, target)

    def fail_after_one(stream):
        stream.put(torch.ones(10))
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_streamed(target, fail_after_one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    assert torch.equal(torch.load(target, weights_only=True)["old"], torch.ones(2))


@pytest.mark.parametrize("mmap", [False, True])
def test_reserved_tensors_filled_in_pieces_load_as_torch_save(tmp_path, mmap):
    torch.manual_seed(0)
    big, per_row, step = torch.randn(50, 8), torch.randn(50), torch.tensor(3.0)
    half = torch.randn(7, 3, dtype=torch.float16)
    stored = {}

    def write(stream):
        stored.update(big=stream.reserve((50, 8)), per_row=stream.reserve((50,)), step=stream.reserve(()))
        stored["half"] = stream.reserve((7, 3), torch.float16)
        return {"w": stored["big"], "s": {"sum": stored["per_row"], "step": stored["step"]}, "h": stored["half"]}

    def fill(stream):
        for a in range(0, 50, 7):  # rows in pieces, out of order with the other tensors
            stream.fill(stored["big"], a * 8, big[a : a + 7])
            stream.fill(stored["per_row"], a, per_row[a : a + 7])
        stream.fill(stored["step"], 0, step.reshape(1))
        stream.fill(stored["half"], 0, half)

    save_streamed(tmp_path / "r.ckpt", write, fill)
    got = torch.load(tmp_path / "r.ckpt", weights_only=True, mmap=mmap)
    want = {"w": big, "s": {"sum": per_row, "step": step}, "h": half}
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fill_refuses_what_does_not_fit(tmp_path):
    def write(stream):
        stored = stream.reserve((4, 2))
        with pytest.raises(RuntimeError, match=r"the archive is still open; fill after close\(\)"):
            stream.fill(stored, 0, torch.zeros(8))
        return {"w": stored}

    def fill(stream):
        stored = stream._reserved["0"]
        with pytest.raises(ValueError, match=r"elements \[4, 12\) of torch.float32 do not fit record data/0 \(8 "):
            stream.fill(stored, 4, torch.zeros(8))
        with pytest.raises(ValueError, match=r"elements \[0, 2\) of torch.float64 do not fit"):
            stream.fill(stored, 0, torch.zeros(2, dtype=torch.float64))
        other = type(stored)("0", torch.float32, (4, 2))
        with pytest.raises(ValueError, match="record data/0 was not reserved in this file"):
            stream.fill(other, 0, torch.zeros(2))
        stream.fill(stored, 0, torch.ones(8))

    save_streamed(tmp_path / "f.ckpt", write, fill)
    assert torch.equal(torch.load(tmp_path / "f.ckpt", weights_only=True)["w"], torch.ones(4, 2))


def _no_read_back(monkeypatch):
    def refuse(*args):
        raise AssertionError("a record filled in order was read back for its CRC-32")

    monkeypatch.setattr(streamed_file, "crc_of_range", refuse)


def _odd(stream, fills):
    """Reserve tensors of sizes that are multiples of neither 4 bytes nor the band, and empty ones."""
    torch.manual_seed(1)
    values = {
        "f16": torch.randn(7, 3, dtype=torch.float16),  # 42 bytes
        "f32": torch.randn(13),
        "u8": torch.randint(0, 255, (11,), dtype=torch.uint8),
        "empty": torch.zeros(0),
        "empty_rows": torch.zeros(0, 4),
    }
    stored = {k: stream.reserve(tuple(v.shape), v.dtype) for k, v in values.items()}
    fills.update({k: (stored[k], v.reshape(-1)) for k, v in values.items()})
    return {"t": stored, "dense": torch.arange(5.0)}, values


def _fill_in_bands(stream, fills, band, order=lambda bands: bands):
    for target, flat in fills.values():
        for a in order(list(range(0, flat.numel(), band))):
            stream.fill(target, a, flat[a : a + band])


@pytest.mark.parametrize("band", [1, 5, 100])
def test_reserved_records_filled_in_bands_carry_their_zip_crc32(tmp_path, monkeypatch, valid_zip, band):
    """Each band's bytes feed the record's running CRC-32: no read back, and zip tools pass the file."""
    _no_read_back(monkeypatch)
    fills, want = {}, {}

    def write(stream):
        obj, values = _odd(stream, fills)
        want.update(values)
        return obj

    save_streamed(tmp_path / "o.ckpt", write, lambda stream: _fill_in_bands(stream, fills, band))
    got = torch.load(tmp_path / "o.ckpt", weights_only=True)
    torch.testing.assert_close(got["t"], want, rtol=0, atol=0)
    archive = zipfile.ZipFile(tmp_path / "o.ckpt")
    f16 = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    assert f16.CRC == zlib.crc32(want["f16"].numpy().tobytes()) != 0
    valid_zip(tmp_path / "o.ckpt")


def test_reserved_file_is_byte_for_byte_torch_save_layout(tmp_path):
    """Reserved and filled, or written whole: the same bytes (headers, data descriptors, central directory),
    but for the serialization id (torch sums its records' CRCs as written: 0 for reserved ones)."""
    torch.manual_seed(2)
    values = [torch.randn(9, 5), torch.randn(3, dtype=torch.float16), torch.zeros(0)]
    reserved, whole = tmp_path / "a" / "m.ckpt", tmp_path / "b" / "m.ckpt"  # one name: one archive folder
    stored = []

    def write(stream):
        stored.extend(stream.reserve(tuple(v.shape), v.dtype) for v in values)
        return list(stored)

    def fill(stream):
        for s, v in zip(stored, values, strict=True):
            stream.fill(s, 0, v)

    save_streamed(reserved, write, fill)
    save_streamed(whole, lambda stream: [stream.put(v) for v in values])
    a, b = reserved.read_bytes(), whole.read_bytes()
    with zipfile.ZipFile(whole) as archive:
        last = archive.infolist()[-1]  # the serialization id, written last
        assert last.filename.endswith("serialization_id")
        allowed = range(last.header_offset, archive.start_dir)  # its record: header, data, descriptor
        entry = b.rindex(b"PK\x01\x02")  # its central directory entry: the CRC field
        allowed_crc = range(entry + 16, entry + 20)
    assert len(a) == len(b)
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert differ  # the serialization id
    assert all(i in allowed or i in allowed_crc for i in differ), differ


def test_records_filled_out_of_order_are_read_back_for_their_crc32(tmp_path, monkeypatch, valid_zip):
    """Bands in reverse, one band written twice, a record never filled: read back in (7-byte) chunks."""
    monkeypatch.setattr(zip_crc, "CHUNK_BYTES", 7)
    read_back = []
    real = streamed_file.crc_of_range
    monkeypatch.setattr(streamed_file, "crc_of_range", lambda *a: read_back.append(a[2]) or real(*a))
    fills, want = {}, {}

    def write(stream):
        obj, values = _odd(stream, fills)
        want.update(values, unfilled=torch.zeros(3, 3))
        obj["t"]["unfilled"] = stream.reserve((3, 3))
        return obj

    def fill(stream):
        _fill_in_bands(stream, dict(list(fills.items())[:2]), 4, order=lambda bands: bands[::-1])  # f16, f32
        target, flat = fills["u8"]
        stream.fill(target, 0, flat)
        stream.fill(target, 2, flat[2:5])  # again, the same values: out of order all the same

    save_streamed(tmp_path / "r.ckpt", write, fill)
    assert sorted(read_back) == [11, 36, 21 * 2, 13 * 4]  # u8, unfilled (9 fp32 zeros), f16, f32
    torch.testing.assert_close(torch.load(tmp_path / "r.ckpt", weights_only=True)["t"], want, rtol=0, atol=0)
    valid_zip(tmp_path / "r.ckpt")


def test_a_flipped_byte_is_named_by_the_zip_check(tmp_path, unzip_t):
    fills = {}
    save_streamed(tmp_path / "m.ckpt", lambda stream: _odd(stream, fills)[0], lambda s: _fill_in_bands(s, fills, 4))
    with zipfile.ZipFile(tmp_path / "m.ckpt") as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/1"))  # f32
        at = bytes((tmp_path / "m.ckpt").read_bytes()).index(archive.read(info), info.header_offset)
    raw = bytearray((tmp_path / "m.ckpt").read_bytes())
    raw[at + 17] ^= 0x01
    (tmp_path / "m.ckpt").write_bytes(raw)
    assert zipfile.ZipFile(tmp_path / "m.ckpt").testzip() == info.filename
    verdict = unzip_t(tmp_path / "m.ckpt")
    if verdict is not None:
        assert verdict[0] != 0 and re.search(rf"{re.escape(info.filename)}\s+bad CRC", verdict[1]), verdict[1]


def test_no_crc32_when_torch_is_told_not_to(tmp_path):
    """``torch.serialization.set_crc32_options(False)``: no CRC-32 on any record, as torch.save writes then."""
    fills = {}
    torch.serialization.set_crc32_options(False)
    try:
        save_streamed(tmp_path / "n.ckpt", lambda s: _odd(s, fills)[0], lambda s: _fill_in_bands(s, fills, 4))
    finally:
        torch.serialization.set_crc32_options(True)
    crcs = {i.filename.split("/", 1)[1]: i.CRC for i in zipfile.ZipFile(tmp_path / "n.ckpt").infolist()}
    assert crcs["data/0"] == crcs["data/5"] == 0  # a reserved record, the dense tensor put whole


def test_a_failed_crc_write_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "c.ckpt"
    torch.save({"old": torch.ones(2)}, target)

    def fail(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(streamed_file, "patch_crcs", fail)
    fills = {}
    with pytest.raises(OSError, match="disk gone"):
        save_streamed(target, lambda s: _odd(s, fills)[0], lambda s: _fill_in_bands(s, fills, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    assert torch.equal(torch.load(target, weights_only=True)["old"], torch.ones(2))


def test_crc_errors_name_the_record_and_the_place(tmp_path):
    stored = {}

    def write(stream):
        stored["w"] = stream.reserve((15,))
        with pytest.raises(RuntimeError, match=r"write_crcs: the archive is still open; write the CRCs after close"):
            stream.write_crcs()
        return stored

    save_streamed(tmp_path / "e.ckpt", write, lambda s: s.fill(stored["w"], 0, torch.arange(15.0)))
    path = tmp_path / "e.ckpt"
    with pytest.raises(CheckpointError, match=r"zip archive .*e.ckpt: no record \['data/9'\] to write the CRC-32 of"):
        zip_crc.patch_crcs(path, {"data/9": 1})
    pristine = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = archive.infolist()[0]
        start_dir = archive.start_dir
    descriptor = pristine.index(b"PK\x07\x08", info.header_offset)
    for at, message in [
        (descriptor + 8, rf"zip record '{re.escape(info.filename)}': no data descriptor of 60 bytes at byte "),
        (info.header_offset + 1, rf"zip record '{re.escape(info.filename)}': no local header at byte 0"),
    ]:
        broken = bytearray(pristine)
        broken[at] ^= 0xFF
        path.write_bytes(broken)
        with pytest.raises(CheckpointError, match=message):
            zip_crc.patch_crcs(path, {"data/0": 1})
        assert path.read_bytes() == broken  # nothing written
    path.write_bytes(pristine)
    no_entry = rf"zip central directory: no entry for '{re.escape(info.filename)}'"
    with zipfile.ZipFile(path) as archive, pytest.raises(CheckpointError, match=no_entry):
        zip_crc._central_offsets(archive, b"\0" * 4 + pristine[start_dir:])  # not the directory zipfile listed
    fd = os.open(path, os.O_RDONLY)
    try:
        end = len(pristine)
        with pytest.raises(CheckpointError, match=rf"reading back bytes \[{end}, {end + 10}\): the file ends early"):
            zip_crc.crc_of_range(fd, end - 5, 15)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_zip64_records_past_4_gib_carry_their_crc32(tmp_path):
    """A reserved record of 4 GiB + 64 bytes (left a hole: no disk, read back as zeros) makes torch's writer use
    zip64 (64-bit sizes in its data descriptor, the next record's offset past 4 GiB); both get their CRC-32."""
    if os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize < 1 << 30:
        pytest.skip("needs a little disk for the sparse 4 GiB file's metadata")
    stored = {}
    small = torch.randn(5, 3)

    def write(stream):
        stored.update(big=stream.reserve((2**30 + 16,)), small=stream.reserve((5, 3)))
        return stored

    def fill(stream):
        stream.fill(stored["big"], 2**30, torch.arange(16.0))  # the last 64 bytes only
        stream.fill(stored["small"], 0, small[:2])
        stream.fill(stored["small"], 6, small[2:])

    save_streamed(tmp_path / "z.ckpt", write, fill)
    with zipfile.ZipFile(tmp_path / "z.ckpt") as archive:
        big, after = archive.infolist()[:2]
        assert big.file_size > 0xFFFFFFFF and after.header_offset > 0xFFFFFFFF  # zip64 sizes and offsets
        assert zlib.crc32(small.numpy().tobytes()) == after.CRC
        assert archive.testzip() is None
    got = torch.load(tmp_path / "z.ckpt", weights_only=True, mmap=True)
    assert torch.equal(got["small"], small) and torch.equal(got["big"][-16:], torch.arange(16.0))
