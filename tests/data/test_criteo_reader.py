"""Criteo streaming reader: parse, hash, log, gzip, malformed lines, file discovery."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_shardrec.data import CriteoReader, criteo_tables, find_criteo_files
from lightning_shardrec.data.criteo import (
    NUM_SPARSE,
    SPARSE_NAMES,
    CriteoChunk,
    chunk_to_batch,
    table_sizes,
)


def _expected(lines: list[str], sizes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference parse, one value at a time."""
    labels, dense, sparse = [], [], []
    for line in lines:
        tok = line.split("\t")
        labels.append(float(tok[0]))
        dense.append([math.log(max(int(t), 0) + 1) if t else 0.0 for t in tok[1:14]])
        sparse.append([int(t, 16) % n if t else 0 for t, n in zip(tok[14:], sizes, strict=True)])
    return np.array(labels), np.array(dense), np.array(sparse)


def _read_all(reader: CriteoReader) -> CriteoChunk:
    chunks = list(reader)
    return CriteoChunk(
        *(
            np.concatenate(parts)
            for parts in zip(*((c.dense, c.sparse, c.labels) for c in chunks), strict=True)
        )
    )


@pytest.mark.parametrize("name", ["day_0", "day_0.gz", "train.txt"])
@pytest.mark.parametrize("chunk_rows", [7, 1000])
def test_parse_hash_and_log_match_reference(
    tmp_path: Path, criteo_lines, write_criteo, name: str, chunk_rows: int
) -> None:
    lines = criteo_lines(50)
    sizes = [1000 + 7 * j for j in range(NUM_SPARSE)]
    path = write_criteo(tmp_path / name, lines)
    reader = CriteoReader(path, num_embeddings=sizes, chunk_rows=chunk_rows)
    got = _read_all(reader)
    labels, dense, sparse = _expected(lines, sizes)
    assert reader.rows == 50 and reader.bad_lines == 0
    np.testing.assert_array_equal(got.labels, labels)
    np.testing.assert_allclose(got.dense, dense, rtol=1e-6)
    np.testing.assert_array_equal(got.sparse, sparse)
    assert got.dense.dtype == np.float32 and got.labels.dtype == np.float32


def test_specific_values(tmp_path: Path, write_criteo) -> None:
    row = [
        "1",
        "0",
        "",
        "-5",
        "9",
        *[""] * 9,
        "ff",
        "",
        "0000000A",
        "FFFFFFFFFFFFFFFF",
        *["1"] * 22,
    ]
    path = write_criteo(tmp_path / "day_3", ["\t".join(row)])
    chunk = _read_all(CriteoReader(path, num_embeddings=100))
    np.testing.assert_allclose(chunk.dense[0, :4], [0.0, 0.0, 0.0, math.log(10)], rtol=1e-6)
    assert chunk.sparse[0, :4].tolist() == [255 % 100, 0, 10, (2**64 - 1) % 100]  # blank -> 0
    assert chunk.labels.tolist() == [1.0]


def test_crlf_line_endings(tmp_path: Path, criteo_lines) -> None:
    lines = criteo_lines(5)
    path = tmp_path / "train.txt"
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    assert len(_read_all(CriteoReader(path))) == 5


def _bad_rows(lines: list[str]) -> list[tuple[str, str]]:
    tab = "\t"
    good = lines[0].split(tab)
    return [
        (tab.join(good[:39]), "expected 40 tab-separated columns .* got 39"),
        (tab.join(good + ["x"]), "expected 40 tab-separated columns .* got 41"),
        (tab.join(["2", *good[1:]]), "label must be 0 or 1, got b'2'"),
        (
            tab.join([good[0], "1.5", *good[2:]]),
            "dense column int_0 must be a 64-bit integer or blank, got b'1.5'",
        ),
        (
            tab.join([*good[:5], "+3", *good[6:]]),
            "dense column int_4 must be a 64-bit integer or blank, got b'\\+3'",
        ),
        (
            tab.join([*good[:14], "zz12", *good[15:]]),
            "categorical column cat_0 must be hex of at most 16 digits",
        ),
        (
            tab.join([*good[:39], "1" * 17]),
            "categorical column cat_25 must be hex of at most 16 digits",
        ),
        ("", "expected 40 tab-separated columns .* got 1"),
    ]


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("name", ["day_0", "day_0.gz"])
def test_bad_line_errors_name_file_and_line(
    tmp_path: Path, criteo_lines, write_criteo, case: int, name: str
) -> None:
    lines = criteo_lines(10)
    bad, reason = _bad_rows(lines)[case]
    lines.insert(6, bad)  # line 7
    path = write_criteo(tmp_path / name, lines)
    with pytest.raises(ValueError, match=rf"criteo file .*{name}: line 7: {reason}"):
        list(CriteoReader(path, chunk_rows=4))


def test_skip_counts_bad_lines_and_keeps_the_rest(
    tmp_path: Path, criteo_lines, write_criteo
) -> None:
    lines = criteo_lines(20)
    bads = [row for row, _ in _bad_rows(lines)]
    mixed = lines[:5] + bads[:4] + lines[5:] + bads[4:]
    path = write_criteo(tmp_path / "day_1.gz", mixed)
    reader = CriteoReader(path, num_embeddings=500, on_bad_line="skip", chunk_rows=6)
    got = _read_all(reader)
    labels, dense, sparse = _expected(lines, [500] * NUM_SPARSE)
    assert reader.bad_lines == 8 and reader.rows == 20
    np.testing.assert_array_equal(got.sparse, sparse)
    np.testing.assert_array_equal(got.labels, labels)


def _truncated(tmp_path: Path, lines: list[str]) -> Path:
    full = gzip.compress(("\n".join(lines) + "\n").encode())
    path = tmp_path / "day_2.gz"
    path.write_bytes(full[: len(full) - 40])
    return path


def test_truncated_gzip_errors_or_is_skipped(tmp_path: Path, criteo_lines) -> None:
    lines = criteo_lines(300)
    path = _truncated(tmp_path, lines)
    with pytest.raises(
        ValueError, match=r"day_2.gz: line \d+: compressed data is truncated or corrupt"
    ):
        list(CriteoReader(path))
    reader = CriteoReader(path, on_bad_line="skip", chunk_rows=50)
    got = _read_all(reader)
    assert reader.bad_lines == 1 and 0 < reader.rows < 300
    _, _, sparse = _expected(lines[: reader.rows], [100_000] * NUM_SPARSE)
    np.testing.assert_array_equal(got.sparse, sparse)  # everything read before the cut is intact


def test_reader_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_bad_line must be one of error, skip; got 'ignore'"):
        CriteoReader(tmp_path / "x", on_bad_line="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_rows must be a positive int, got 0"):
        CriteoReader(tmp_path / "x", chunk_rows=0)
    with pytest.raises(ValueError, match="need 1 or 26 table sizes, got 3"):
        table_sizes([1, 2, 3])
    with pytest.raises(
        ValueError, match="num_embeddings must be ints in \\[1, 2\\*\\*63\\): cat_1=0"
    ):
        table_sizes([5, 0] + [5] * 24)


def test_find_files(tmp_path: Path, write_criteo, criteo_lines) -> None:
    lines = criteo_lines(1)
    for n in (10, 2, 0):
        write_criteo(tmp_path / (f"day_{n}.gz" if n else f"day_{n}"), lines)
    (tmp_path / "README").write_text("x")
    assert [p.name for p in find_criteo_files(tmp_path)] == ["day_0", "day_2.gz", "day_10.gz"]
    write_criteo(tmp_path / "day_2", lines)
    with pytest.raises(ValueError, match=r"both day_N and day_N.gz for N in \[2\]; keep one"):
        find_criteo_files(tmp_path)
    kaggle = tmp_path / "kaggle"
    kaggle.mkdir()
    write_criteo(kaggle / "train.txt", lines)
    assert [p.name for p in find_criteo_files(kaggle)] == ["train.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=r"has no day_0..day_23\[.gz\] or train.txt\[.gz\]; found: nothing"
    ):
        find_criteo_files(empty)
    with pytest.raises(ValueError, match="is not a directory"):
        find_criteo_files(tmp_path / "missing")


def test_chunk_to_batch_and_tables(tmp_path: Path, write_criteo, criteo_lines) -> None:
    path = write_criteo(tmp_path / "day_0", criteo_lines(6))
    chunk = _read_all(CriteoReader(path, num_embeddings=50))
    batch = chunk_to_batch(chunk)
    assert batch.batch_size == 6 and batch.sparse.keys() == list(SPARSE_NAMES)
    assert torch.equal(batch.sparse["cat_3"].values(), torch.from_numpy(chunk.sparse[:, 3]))
    assert bool((batch.sparse.lengths() == 1).all())
    tables = criteo_tables(16, 50)
    assert (
        len(tables) == 26
        and tables[3].feature_names == ["cat_3"]
        and tables[3].num_embeddings == 50
    )


def test_raw_ids_keep_the_64_bit_hex_values(tmp_path: Path, criteo_lines, write_criteo) -> None:
    lines = criteo_lines(20)
    cats = ["ffffffffffffffff", "", "8000000000000000", "68FD1E64"] + [f"{j:x}" for j in range(NUM_SPARSE - 4)]
    lines.append("\t".join(["1", *[""] * 13, *cats]))
    path = write_criteo(tmp_path / "day_0", lines)
    got = _read_all(CriteoReader(path, num_embeddings=7, raw_ids=True, chunk_rows=8))
    want = [[int(t, 16) if t else 0 for t in line.split("\t")[14:]] for line in lines]
    assert got.sparse.dtype == np.int64
    assert got.sparse.view(np.uint64).tolist() == want  # the raw value, as two's-complement int64
    assert got.sparse[-1, :4].tolist() == [-1, 0, -(2**63), 0x68FD1E64]
    hashed = _read_all(CriteoReader(path, num_embeddings=7))
    np.testing.assert_array_equal(hashed.sparse, (got.sparse.view(np.uint64) % 7).astype(np.int64))
