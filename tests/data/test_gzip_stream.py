"""CheckedGzip: what gzip.open reads from good files, and nothing decoded from junk after a cut."""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path

import numpy as np
import pytest

from lightning_shardrec.data.gzip_stream import HOLD_BYTES, CheckedGzip


def _read(path: Path) -> tuple[bytes, BaseException | None]:
    """The lines read (joined, as the Criteo reader iterates), and the exception that ended them."""
    out = bytearray()
    with io.BufferedReader(CheckedGzip(path), buffer_size=97) as f:
        try:
            for line in f:
                out += line
        except (EOFError, zlib.error) as e:
            return bytes(out), e
    return bytes(out), None


def test_members_and_nul_padding_read_like_gzip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 16, n).astype(np.uint8).tobytes() for n in (0, 5, 3 * HOLD_BYTES, 70_000)]
    path = tmp_path / "x.gz"
    path.write_bytes(b"".join(gzip.compress(p) + b"\0" * i for i, p in enumerate(parts)))
    assert _read(path) == (b"".join(parts), None) and gzip.decompress(path.read_bytes()) == b"".join(parts)
    (tmp_path / "e.gz").write_bytes(b"")
    assert _read(tmp_path / "e.gz") == (b"", None)


def test_junk_after_a_member_or_before_the_first_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(b"abc\n") + b"\0\0junk")
    data, err = _read(path)
    assert data == b"abc\n" and isinstance(err, zlib.error)  # the member checked out: all of it
    path.write_bytes(b"\0" + gzip.compress(b"abc\n"))
    assert _read(path)[1] is not None


def test_cut_stream_returns_only_bytes_decoded_before_the_cut(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    data = b"\n".join(f"{x:x}".encode() for x in rng.integers(0, 2**40, 3000)) + b"\n"
    blob = gzip.compress(data)
    path = tmp_path / "x.gz"
    for cut, junk in ((len(blob) - 9, b""), (len(blob) - 1990, b"\x97p\n\xea"), (100, bytes(range(40)))):
        path.write_bytes(blob[:cut] + junk)
        got, err = _read(path)
        assert err is not None and data.startswith(got), (cut, junk)
        trusted = zlib.decompressobj(31).decompress(blob[: max(cut - 2 * HOLD_BYTES, 0)])
        assert len(got) >= len(trusted) - 11  # at most one partial line (of <= 11 bytes) lost
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(EOFError, match="compressed file ended before the end-of-stream marker was reached"):
        CheckedGzip(path).read()
