"""StreamedFile: a torch.save archive written one tensor at a time reads back as torch.save's would."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.checkpoint import save_streamed


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
