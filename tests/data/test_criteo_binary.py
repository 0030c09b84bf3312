"""Criteo preprocessing to memory-mapped .npy, and per-rank binary datasets."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_shardrec.data import (
    CriteoBinary,
    CriteoBinaryDataset,
    CriteoReader,
    RecBatchLoader,
    find_criteo_files,
    preprocess_criteo,
)
from lightning_shardrec.data.criteo_binary import split_ranges


def _streamed(files: list[Path], sizes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = [c for f in files for c in CriteoReader(f, num_embeddings=sizes, chunk_rows=64)]
    return tuple(
        np.concatenate([getattr(c, k) for c in chunks]) for k in ("dense", "sparse", "labels")
    )  # type: ignore[return-value]


def test_round_trip_equals_streaming(criteo_day_dir: Path, tmp_path: Path) -> None:
    files = find_criteo_files(criteo_day_dir)
    meta = preprocess_criteo(files, tmp_path / "p", num_embeddings=777, chunk_rows=64)
    assert (
        meta.rows == 500
        and [f.rows for f in meta.files] == [300, 200]
        and meta.sparse_dtype == "int32"
    )
    data = CriteoBinary(tmp_path / "p")
    dense, sparse, labels = _streamed(files, 777)
    got = data.read(0, 500)  # spans both files
    np.testing.assert_array_equal(got.dense, dense)
    np.testing.assert_array_equal(got.sparse, sparse)
    np.testing.assert_array_equal(got.labels, labels)
    part = data.read(290, 310)  # across the file boundary
    np.testing.assert_array_equal(part.sparse, sparse[290:310])
    assert np.load(tmp_path / "p" / "day_0.dense.npy", mmap_mode="r").shape == (300, 13)
    assert not list((tmp_path / "p").glob("*.tmp"))


def test_preprocess_is_idempotent_and_checks_sources(criteo_day_dir: Path, tmp_path: Path) -> None:
    files = find_criteo_files(criteo_day_dir)
    first = preprocess_criteo(files, tmp_path / "p", num_embeddings=100)
    assert preprocess_criteo(files, tmp_path / "p", num_embeddings=100) == first
    with pytest.raises(
        ValueError,
        match=r"holds sources \['day_0.gz', 'day_1'\] with num_embeddings \[100, .*not "
        r"\['day_0.gz'\] with \[100, .*delete it or use another processed_dir",
    ):
        preprocess_criteo(files[:1], tmp_path / "p", num_embeddings=100)
    with pytest.raises(
        ValueError,
        match=r"criteo processed_dir '.*p' holds hashed ids, not raw \(raw_ids=True\); delete it or use another",
    ):
        preprocess_criteo(files, tmp_path / "p", num_embeddings=100, raw_ids=True)
    raw = preprocess_criteo(files, tmp_path / "raw", num_embeddings=100, raw_ids=True)
    assert raw.raw_ids and raw.sparse_dtype == "int64" and not first.raw_ids
    assert CriteoBinary(tmp_path / "raw").read(0, 5).sparse.dtype == np.int64


def test_bad_lines_recorded_in_meta(tmp_path: Path, criteo_lines, write_criteo) -> None:
    src = write_criteo(
        tmp_path / "train.txt", criteo_lines(10)[:5] + ["1\t2"] + criteo_lines(10)[5:]
    )
    with pytest.raises(ValueError, match=r"train.txt: line 6: expected 40"):
        preprocess_criteo([src], tmp_path / "err")
    assert not (
        tmp_path / "err" / "meta.json"
    ).exists()  # an unfinished conversion is never taken as done
    meta = preprocess_criteo([src], tmp_path / "p", on_bad_line="skip")
    assert meta.bad_lines == 1 and meta.rows == 10


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_disjoint_same_count_and_equal_one_rank(
    criteo_day_dir: Path, tmp_path: Path, world_size: int
) -> None:
    preprocess_criteo(find_criteo_files(criteo_day_dir), tmp_path / "p", num_embeddings=1000)
    data = CriteoBinary(tmp_path / "p")
    b, rows = 10, (20, 480)
    ranks = [
        list(CriteoBinaryDataset(data, rows, batch_size=b, rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    single = list(CriteoBinaryDataset(data, rows, batch_size=b * world_size))
    n = 460 // (b * world_size)
    assert all(len(batches) == n for batches in ranks) and len(single) == n
    for i in range(n):
        dense = torch.cat([ranks[r][i].dense for r in range(world_size)])
        assert torch.equal(dense, single[i].dense)
        ids = torch.cat([ranks[r][i].sparse["cat_5"].values() for r in range(world_size)])
        assert torch.equal(ids, single[i].sparse["cat_5"].values())
    # disjoint and, up to the dropped remainder, complete: every row read exactly once
    seen = torch.cat([b_.dense for batches in ranks for b_ in batches])
    expected = torch.from_numpy(data.read(rows[0], rows[0] + n * b * world_size).dense)
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))


def test_workers_preserve_order_and_pickle_remaps(criteo_day_dir: Path, tmp_path: Path) -> None:
    preprocess_criteo(find_criteo_files(criteo_day_dir), tmp_path / "p", num_embeddings=1000)
    data = CriteoBinary(tmp_path / "p")
    assert len(pickle.dumps(data)) < 1000  # workers re-map the files instead of copying them
    assert len(pickle.loads(pickle.dumps(data))) == 500
    ds = CriteoBinaryDataset(data, (0, 500), batch_size=16, rank=1, world_size=2)
    expected = [ds.batch(i).dense for i in range(len(ds))]
    got = [b.dense for b in RecBatchLoader(ds, num_workers=2)]
    assert len(got) == len(expected) == 15 and all(
        torch.equal(x, y) for x, y in zip(got, expected, strict=True)
    )


def test_splits_and_errors(criteo_day_dir: Path, tmp_path: Path) -> None:
    assert split_ranges(100, 0.1, 0.05) == {"train": (0, 85), "val": (85, 95), "test": (95, 100)}
    with pytest.raises(ValueError, match="has no meta.json; run preprocess_criteo first"):
        CriteoBinary(tmp_path)
    preprocess_criteo(find_criteo_files(criteo_day_dir), tmp_path / "p", num_embeddings=1000)
    data = CriteoBinary(tmp_path / "p")
    with pytest.raises(ValueError, match=r"rows \[0, 501\) outside the data's \[0, 500\)"):
        CriteoBinaryDataset(data, (0, 501), batch_size=4)
    with pytest.raises(IndexError, match=r"criteo rows \[490, 510\) outside \[0, 500\)"):
        data.read(490, 510)
    with pytest.raises(IndexError, match=r"batch index 5 not in \[0, 5\)"):
        CriteoBinaryDataset(data, (0, 100), batch_size=20).batch(5)
    with pytest.raises(
        ValueError, match="CriteoBinaryDataset: world_size must be a positive int, got 0"
    ):
        CriteoBinaryDataset(data, (0, 100), batch_size=20, world_size=0)


def test_format_version_mismatch(criteo_day_dir: Path, tmp_path: Path) -> None:
    preprocess_criteo(find_criteo_files(criteo_day_dir), tmp_path / "p", num_embeddings=10)
    meta = tmp_path / "p" / "meta.json"
    meta.write_text(meta.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(
        ValueError, match="has format version 99, this reader reads 1; preprocess again"
    ):
        CriteoBinary(tmp_path / "p")
