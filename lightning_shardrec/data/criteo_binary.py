"""Criteo preprocessed once into memory-mapped ``.npy`` files, then read per rank. No Lightning.

Layout of ``processed_dir`` (one triple per source file, in source order)::

    meta.json                  sources, rows and bad lines per file, table sizes
    day_0.dense.npy   [n, 13]  float32, log(max(x, 0) + 1)
    day_0.sparse.npy  [n, 26]  int32 (int64 if a table has more than 2**31 rows), already hashed
                               (int64 raw 64-bit ids with ``raw_ids=True``)
    day_0.labels.npy  [n]      uint8

The files concatenate into one row space, split contiguously into
``train | val | test`` (the last ``val_fraction + test_fraction`` of rows, in order).
A split of ``R`` rows gives ``R // (batch_size * world_size)`` global batches; rank
``r`` reads rows ``[r * B, (r + 1) * B)`` of each (one contiguous block), so ranks
are disjoint, all get the same number of batches, and the global batches do not
depend on the world size. The last ``R % (B * W)`` rows are dropped.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.data.criteo import (
    NUM_DENSE,
    NUM_SPARSE,
    CriteoChunk,
    CriteoReader,
    OnBadLine,
    chunk_to_batch,
    table_sizes,
)
from lightning_shardrec.data.loader import IndexedBatchDataset

FORMAT_VERSION = 1
_HEADER_LEN = 128  # fixed .npy header, rewritten with the row count at the end
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class SourceFile:
    source: str
    stem: str
    rows: int
    bad_lines: int


@dataclass(frozen=True)
class CriteoMeta:
    """What ``meta.json`` records; written last, so its presence means preprocessing finished."""

    num_embeddings: tuple[int, ...]
    sparse_dtype: str
    files: tuple[SourceFile, ...]
    version: int = FORMAT_VERSION
    raw_ids: bool = False

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def bad_lines(self) -> int:
        return sum(f.bad_lines for f in self.files)

    @staticmethod
    def load(path: Path) -> CriteoMeta:
        """Read ``meta.json``; a corrupt or foreign file is a ``ValueError`` naming it."""
        try:
            d = json.loads(path.read_text())
            if not isinstance(d.get("files"), list):
                raise ValueError(f"files is {d.get('files')!r}, not a list")
            files = tuple(SourceFile(**f) for f in d.pop("files"))
            meta = CriteoMeta(num_embeddings=tuple(d.pop("num_embeddings")), files=files, **d)
            problem = meta._problem()
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSON, fields, types
            problem = f"{type(e).__name__}: {e}"
        if problem:
            raise ValueError(
                f"criteo {path} is not a preprocess_criteo meta.json ({problem}); "
                "delete the directory and preprocess again"
            )
        return meta

    def _problem(self) -> str | None:
        """What is wrong with the recorded fields (types and ranges), or ``None``."""

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        if not isinstance(self.version, int) or isinstance(self.version, bool):
            return f"version {self.version!r} is not an int"
        if not isinstance(self.raw_ids, bool):
            return f"raw_ids {self.raw_ids!r} is not a bool"
        if self.sparse_dtype not in ("int32", "int64"):
            return f"sparse_dtype {self.sparse_dtype!r} is not int32 or int64"
        if len(self.num_embeddings) != NUM_SPARSE or not all(count(n) and n > 0 for n in self.num_embeddings):
            return f"num_embeddings {list(self.num_embeddings)} are not {NUM_SPARSE} positive ints"
        for f in self.files:
            if not (isinstance(f.stem, str) and f.stem and "/" not in f.stem and count(f.rows) and count(f.bad_lines)):
                return f"file entry {f} needs a plain stem and row counts >= 0"
        return None


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    body = repr(
        {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    ).encode()
    return (
        b"\x93NUMPY\x01\x00"
        + struct.pack("<H", _HEADER_LEN - 10)
        + body.ljust(_HEADER_LEN - 11)
        + b"\n"
    )


class _NpyAppender:
    """Write a ``.npy`` row by row without knowing the row count up front."""

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape, self.rows = path, np.dtype(dtype), row_shape, 0
        self.f: BinaryIO = open(path, "wb")  # noqa: SIM115
        self.f.write(b"\0" * _HEADER_LEN)

    def append(self, a: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(a, dtype=self.dtype).tobytes())
        self.rows += a.shape[0]

    def close(self) -> None:
        self.f.seek(0)
        self.f.write(_npy_header((self.rows, *self.row_shape), self.dtype))
        self.f.close()


def _stem(path: Path) -> str:
    return path.name[:-3] if path.name.endswith(".gz") else path.name


def preprocess_criteo(
    files: Sequence[str | Path],
    processed_dir: str | Path,
    *,
    num_embeddings: int | Sequence[int] = 100_000,
    on_bad_line: OnBadLine = "error",
    chunk_rows: int = 65_536,
    raw_ids: bool = False,
) -> CriteoMeta:
    """Convert ``files`` (streaming, chunk by chunk) into ``processed_dir``; a no-op if already done.

    ``raw_ids=True`` stores the raw 64-bit categorical ids (for dynamic tables) instead of
    hashing them into ``num_embeddings``. Raises ``ValueError`` if ``processed_dir`` holds a
    finished conversion of other sources, table sizes or id kind.
    """
    out = Path(processed_dir)
    sizes = table_sizes(num_embeddings)
    sources = [Path(f) for f in files]
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = CriteoMeta.load(meta_path)
        want = ([s.name for s in sources], tuple(sizes.tolist()))
        have = ([f.source for f in meta.files], meta.num_embeddings)
        if want != have:
            raise ValueError(
                f"criteo processed_dir {str(out)!r} holds sources {have[0]} with num_embeddings "
                f"{list(have[1])}, not {want[0]} with {list(want[1])}; delete it or use another processed_dir"
            )
        if meta.raw_ids != raw_ids:
            raise ValueError(
                f"criteo processed_dir {str(out)!r} holds {'raw' if meta.raw_ids else 'hashed'} ids, not "
                f"{'raw' if raw_ids else 'hashed'} (raw_ids={raw_ids}); delete it or use another processed_dir"
            )
        return meta
    out.mkdir(parents=True, exist_ok=True)
    sparse_dtype = np.dtype(np.int32 if int(sizes.max()) <= 2**31 and not raw_ids else np.int64)
    done = []
    for src in sources:
        stem = _stem(src)
        reader = CriteoReader(
            src, num_embeddings=sizes.tolist(), on_bad_line=on_bad_line, chunk_rows=chunk_rows, raw_ids=raw_ids
        )
        writers = [
            _NpyAppender(out / f"{stem}.dense.npy.tmp", np.dtype(np.float32), (NUM_DENSE,)),
            _NpyAppender(out / f"{stem}.sparse.npy.tmp", sparse_dtype, (NUM_SPARSE,)),
            _NpyAppender(out / f"{stem}.labels.npy.tmp", np.dtype(np.uint8), ()),
        ]
        try:
            for chunk in reader:
                for w, a in zip(writers, (chunk.dense, chunk.sparse, chunk.labels), strict=True):
                    w.append(a)
        finally:
            for w in writers:
                w.close()
        for w in writers:
            os.replace(w.path, w.path.with_suffix(""))
        done.append(
            SourceFile(source=src.name, stem=stem, rows=reader.rows, bad_lines=reader.bad_lines)
        )
    meta = CriteoMeta(
        num_embeddings=tuple(sizes.tolist()), sparse_dtype=sparse_dtype.name, files=tuple(done), raw_ids=raw_ids
    )
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(asdict(meta), indent=1))
    os.replace(tmp, meta_path)
    return meta


class CriteoBinary:
    """The preprocessed files of ``processed_dir`` as one memory-mapped row space."""

    def __init__(self, processed_dir: str | Path) -> None:
        root = self.root = Path(processed_dir)
        if not (root / "meta.json").is_file():
            raise ValueError(
                f"criteo processed_dir {str(root)!r} has no meta.json; run preprocess_criteo first"
            )
        self.meta = CriteoMeta.load(root / "meta.json")
        if self.meta.version != FORMAT_VERSION:
            raise ValueError(
                f"criteo processed_dir {str(root)!r} has format version {self.meta.version}, "
                f"this reader reads {FORMAT_VERSION}; preprocess again"
            )
        self.parts = [self._map(f) for f in self.meta.files]
        self.starts = np.cumsum([0] + [f.rows for f in self.meta.files])

    def _map(self, f: SourceFile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Memory-map one file's arrays, checking their shapes and dtypes against ``meta.json``."""
        want = {
            "dense": ((f.rows, NUM_DENSE), np.dtype(np.float32)),
            "sparse": ((f.rows, NUM_SPARSE), np.dtype(self.meta.sparse_dtype)),
            "labels": ((f.rows,), np.dtype(np.uint8)),
        }
        out = []
        for kind, (shape, dtype) in want.items():
            path = self.root / f"{f.stem}.{kind}.npy"
            try:
                a = np.load(path, mmap_mode="r")
            except Exception as e:  # numpy's header parser fails in many ways (OSError, ValueError, TokenError ...)
                raise ValueError(
                    f"criteo {path} (source {f.stem!r} in meta.json) is missing or corrupt "
                    f"({type(e).__name__}: {e}); preprocess again"
                ) from None
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(
                    f"criteo {path} holds {a.dtype} {a.shape}, meta.json says {dtype} {shape}; preprocess again"
                )
            out.append(a)
        return out[0], out[1], out[2]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Path]:
        return {"root": self.root}  # re-map in DataLoader workers instead of pickling the data

    def __setstate__(self, state: dict[str, Path]) -> None:
        self.__init__(state["root"])  # type: ignore[misc]

    def read(self, lo: int, hi: int) -> CriteoChunk:
        """Rows ``[lo, hi)`` (copied out of the maps; may span files)."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"criteo rows [{lo}, {hi}) outside [0, {len(self)})")
        pieces: list[tuple[np.ndarray, ...]] = []
        k = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            s, e = int(self.starts[k]), int(self.starts[k + 1])
            a, b = lo - s, min(hi, e) - s
            pieces.append(tuple(np.array(m[a:b]) for m in self.parts[k]))
            lo, k = s + b, k + 1
        if not pieces:  # lo == hi: no rows
            sparse = np.dtype(self.meta.sparse_dtype)
            return CriteoChunk(
                np.zeros((0, NUM_DENSE), np.float32), np.zeros((0, NUM_SPARSE), sparse), np.zeros(0, np.uint8)
            )
        if len(pieces) == 1:
            return CriteoChunk(*pieces[0])
        return CriteoChunk(*(np.concatenate(ps) for ps in zip(*pieces, strict=True)))


def split_ranges(
    total: int, val_fraction: float, test_fraction: float
) -> dict[str, tuple[int, int]]:
    """Contiguous ``[lo, hi)`` row ranges of ``train``, ``val``, ``test`` (in that order)."""
    if not (val_fraction >= 0 and test_fraction >= 0 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"criteo split: val_fraction {val_fraction} and test_fraction {test_fraction} must be >= 0 "
            "and sum to less than 1"
        )
    n_val, n_test = int(total * val_fraction), int(total * test_fraction)
    n_train = total - n_val - n_test
    return {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, total),
    }


class CriteoBinaryDataset(IndexedBatchDataset):
    """Rank ``rank``'s slices of the global batches of rows ``[lo, hi)`` of a :class:`CriteoBinary`."""

    def __init__(
        self,
        data: CriteoBinary,
        rows: tuple[int, int],
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        lo, hi = rows
        if not 0 <= lo <= hi <= len(data):
            raise ValueError(
                f"CriteoBinaryDataset: rows [{lo}, {hi}) outside the data's [0, {len(data)})"
            )
        super().__init__(batch_size=batch_size, num_batches=0, rank=rank, world_size=world_size)
        self.num_batches = (hi - lo) // self.global_batch_size
        self.data, self.lo = data, lo

    def batch(self, index: int) -> RecBatch:
        if not 0 <= index < self.num_batches:
            raise IndexError(
                f"CriteoBinaryDataset: batch index {index} not in [0, {self.num_batches})"
            )
        start = self.lo + index * self.global_batch_size + self.rank * self.batch_size
        return chunk_to_batch(self.data.read(start, start + self.batch_size))
