"""Criteo click logs: a streaming TSV reader. No Lightning here.

One line per sample, tab-separated, 40 columns (Terabyte ``day_0.gz .. day_23.gz``
or ``day_N``, Kaggle ``train.txt``; gzip or plain)::

    label \\t int_0 .. int_12 \\t cat_0 .. cat_25
    1     \\t 5 \\t \\t -1 ...   \\t 68fd1e64 \\t \\t ...

- ``label``: ``0`` or ``1``.
- dense ``int_j``: decimal integer or blank; becomes ``log(max(x, 0) + 1)``
  (negatives clamp to 0, blank is 0).
- categorical ``cat_j``: hex (at most 16 digits) or blank; becomes
  ``int(value, 16) % num_embeddings[j]``. A blank (missing) value is id 0 and still
  a bag of length 1, so every sample has exactly one id per feature (id 0 is shared
  by "missing" and values that hash to 0). With ``raw_ids=True`` it is the raw 64-bit
  value of the hex id instead (as int64, two's complement; blank is 0), for tables
  with ``dynamic=DynamicConfig(...)``, which take any int64 id (``docs/dynamic-tables.md``).

Malformed lines (wrong column count, bad label, non-integer dense, non-hex
categorical, truncated/corrupt gzip) raise ``ValueError`` naming the file and the
1-based line number, or with ``on_bad_line="skip"`` are dropped and counted in
:attr:`CriteoReader.bad_lines` (a truncated gzip counts one bad line and ends the file;
the rows decoded from its last ~1 KiB of compressed data are dropped with it, as deflate
cannot tell them from junk decoded after the cut, see :mod:`~lightning_shardrec.data.gzip_stream`).
"""

from __future__ import annotations

import io
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lightning_shardrec.configs import DynamicConfig, EmbeddingBagConfig
from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.data.gzip_stream import CheckedGzip
from lightning_shardrec.sparse import KeyedJaggedTensor

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = tuple(f"int_{j}" for j in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"cat_{j}" for j in range(NUM_SPARSE))
OnBadLine = Literal["error", "skip"]
ON_BAD_LINE = ("error", "skip")

_ALLOWED = b"0123456789abcdefABCDEF-\t"  # every byte of a well-formed block is one of these
_NIBBLE = np.full(256, 255, dtype=np.uint8)  # hex digit value; 0 for NUL padding; 255 invalid
_NIBBLE[0] = 0
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _NIBBLE[ord(chr(_c).upper())] = _i
_DENSE_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]+")


@dataclass(frozen=True)
class CriteoChunk:
    """Parsed rows: ``dense [n, 13]`` float32 (already ``log1p``), ``sparse [n, 26]`` ids, ``labels [n]``."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def table_sizes(num_embeddings: int | Sequence[int]) -> np.ndarray:
    """``[26]`` int64 table sizes from one size for all features or one per feature."""
    sizes = (
        [num_embeddings] * NUM_SPARSE if isinstance(num_embeddings, int) else list(num_embeddings)
    )
    if len(sizes) != NUM_SPARSE:
        raise ValueError(
            f"criteo num_embeddings: need 1 or {NUM_SPARSE} table sizes, got {len(sizes)}"
        )
    bad = [
        f"{SPARSE_NAMES[j]}={s!r}"
        for j, s in enumerate(sizes)
        if not isinstance(s, int) or not 0 < s < 2**63
    ]
    if bad:
        raise ValueError(f"criteo num_embeddings must be ints in [1, 2**63): {', '.join(bad)}")
    return np.asarray(sizes, dtype=np.int64)


def criteo_tables(
    embedding_dim: int,
    num_embeddings: int | Sequence[int] = 100_000,
    dynamic: DynamicConfig | None = None,
) -> list[EmbeddingBagConfig]:
    """One table ``t_cat_j`` per categorical feature ``cat_j``, sized as the reader hashes
    (with ``dynamic``: dynamic tables of that capacity, for raw ids)."""
    sizes = table_sizes(num_embeddings).tolist()
    return [
        EmbeddingBagConfig(
            num_embeddings=n,
            embedding_dim=embedding_dim,
            name=f"t_{f}",
            feature_names=[f],
            dynamic=dynamic,
        )
        for f, n in zip(SPARSE_NAMES, sizes, strict=True)
    ]


def check_on_bad_line(value: str) -> OnBadLine:
    if value not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {', '.join(ON_BAD_LINE)}; got {value!r}")
    return value  # type: ignore[return-value]


class _BadBlock(Exception):
    """A block of lines failed the fast parse; re-check it line by line."""


def _parse_block(lines: list[bytes], sizes: np.ndarray, raw_ids: bool = False) -> CriteoChunk:
    """Vectorised parse of well-formed lines; ``_BadBlock`` if any line is not."""
    n = len(lines)
    if any(line.count(b"\t") != NUM_COLUMNS - 1 for line in lines):
        raise _BadBlock
    blob = b"\t".join(lines)
    if blob.translate(None, _ALLOWED):
        raise _BadBlock
    tok = np.array(blob.split(b"\t")).reshape(n, NUM_COLUMNS)  # bytes, NUL-padded on the right
    is_one = tok[:, 0] == b"1"
    if not (is_one | (tok[:, 0] == b"0")).all():
        raise _BadBlock
    dense_tok = tok[:, 1 : 1 + NUM_DENSE]
    try:
        dense = np.where(dense_tok == b"", b"0", dense_tok).astype(np.int64)
    except (ValueError, OverflowError):
        raise _BadBlock from None
    chars = np.ascontiguousarray(tok[:, 1 + NUM_DENSE :]).view(np.uint8).reshape(n, NUM_SPARSE, -1)
    nibbles = _NIBBLE[chars]
    if (nibbles == 255).any() or (chars[..., 16:] != 0).any():  # "-" or more than 16 digits
        raise _BadBlock
    raw = np.zeros((n, NUM_SPARSE), dtype=np.uint64)
    for k in range(chars.shape[-1]):  # Horner over digit positions (padding NULs are skipped)
        raw = np.where(chars[..., k] != 0, (raw << np.uint64(4)) | nibbles[..., k], raw)
    dense_f = np.log1p(np.maximum(dense, 0).astype(np.float32))
    sparse = raw.view(np.int64) if raw_ids else (raw % sizes.astype(np.uint64)).astype(np.int64)
    return CriteoChunk(dense_f, sparse, is_one.astype(np.float32))


def _line_error(line: bytes) -> str | None:
    """Why one line is malformed (column named), or ``None`` if it is fine."""
    tok = line.split(b"\t")
    if len(tok) != NUM_COLUMNS:
        return (
            f"expected {NUM_COLUMNS} tab-separated columns (label, 13 ints, 26 hex), got {len(tok)}"
        )
    if tok[0] not in (b"0", b"1"):
        return f"label must be 0 or 1, got {tok[0][:40]!r}"
    for name, t in zip(DENSE_NAMES, tok[1 : 1 + NUM_DENSE], strict=True):
        if t and (not _DENSE_RE.fullmatch(t) or not -(2**63) <= int(t) < 2**63):
            return f"dense column {name} must be a 64-bit integer or blank, got {t[:40]!r}"
    for name, t in zip(SPARSE_NAMES, tok[1 + NUM_DENSE :], strict=True):
        if t and (not _HEX_RE.fullmatch(t) or len(t) > 16):
            return f"categorical column {name} must be hex of at most 16 digits or blank, got {t[:40]!r}"
    return None


def _open(path: Path):  # type: ignore[no-untyped-def]
    if path.suffix == ".gz":  # not gzip.open: it returns bytes decoded from junk after a cut
        return io.BufferedReader(CheckedGzip(path), buffer_size=1 << 16)
    return open(path, "rb")  # noqa: SIM115


class CriteoReader:
    """Stream ``path`` as :class:`CriteoChunk` s of at most ``chunk_rows`` rows; never holds the file.

    After (or during) iteration, :attr:`rows` counts rows yielded and
    :attr:`bad_lines` the malformed lines skipped (``on_bad_line="skip"``).
    ``raw_ids=True``: categorical ids are the raw 64-bit hex values, not hashed.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        num_embeddings: int | Sequence[int] = 100_000,
        on_bad_line: OnBadLine = "error",
        chunk_rows: int = 65_536,
        raw_ids: bool = False,
    ) -> None:
        self.path = Path(path)
        self.raw_ids = bool(raw_ids)
        self.sizes = table_sizes(num_embeddings)
        self.on_bad_line = check_on_bad_line(on_bad_line)
        if not isinstance(chunk_rows, int) or chunk_rows <= 0:
            raise ValueError(f"CriteoReader: chunk_rows must be a positive int, got {chunk_rows!r}")
        self.chunk_rows = chunk_rows
        self.rows = 0
        self.bad_lines = 0

    def _bad(self, lineno: int, reason: str) -> None:
        if self.on_bad_line == "error":
            raise ValueError(
                f"criteo file {self.path}: line {lineno}: {reason} (pass on_bad_line='skip' to skip)"
            )
        self.bad_lines += 1

    def _parse(self, lines: list[bytes], first_lineno: int) -> CriteoChunk | None:
        try:
            chunk = _parse_block(lines, self.sizes, self.raw_ids)
        except _BadBlock:
            good = []
            for j, line in enumerate(lines):
                reason = _line_error(line)
                if reason is None:
                    good.append(line)
                else:
                    self._bad(first_lineno + j, reason)
            if not good:
                return None
            chunk = _parse_block(good, self.sizes, self.raw_ids)
        self.rows += len(chunk)
        return chunk

    def __iter__(self) -> Iterator[CriteoChunk]:
        self.rows = self.bad_lines = 0
        lineno = 0  # lines read so far
        lines: list[bytes] = []
        if self.path.suffix == ".gz" and self.path.stat().st_size == 0:  # gzip reads b"" as an empty stream
            self._bad(1, "compressed data is truncated or corrupt (an empty .gz file; a gzip stream has a header)")
            return
        with _open(self.path) as f:
            try:
                for raw in f:
                    lines.append(raw.rstrip(b"\r\n"))
                    if len(lines) == self.chunk_rows:
                        chunk = self._parse(lines, lineno + 1)
                        lineno += len(lines)
                        lines = []
                        if chunk is not None:
                            yield chunk
            except (EOFError, zlib.error) as e:
                lost = lineno + len(lines) + 1
                self._bad(lost, f"compressed data is truncated or corrupt ({e})")
        if lines and (chunk := self._parse(lines, lineno + 1)) is not None:
            yield chunk


def find_criteo_files(data_dir: str | Path) -> list[Path]:
    """Terabyte ``day_N`` / ``day_N.gz`` (sorted by N), else Kaggle ``train.txt`` / ``train.txt.gz``."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"criteo data_dir {str(root)!r} is not a directory")
    days: dict[int, list[Path]] = {}
    for p in root.iterdir():
        m = re.fullmatch(r"day_(\d+)(\.gz)?", p.name)
        if m and p.is_file():
            days.setdefault(int(m.group(1)), []).append(p)
    both = sorted(n for n, ps in days.items() if len(ps) > 1)
    if both:
        raise ValueError(
            f"criteo data_dir {str(root)!r} has both day_N and day_N.gz for N in {both}; keep one"
        )
    if days:
        return [days[n][0] for n in sorted(days)]
    for name in ("train.txt", "train.txt.gz"):
        if (root / name).is_file():
            return [root / name]
    found = sorted(p.name for p in root.iterdir())[:10]
    raise ValueError(
        f"criteo data_dir {str(root)!r} has no day_0..day_23[.gz] or train.txt[.gz]; found: {found or 'nothing'}"
    )


def chunk_to_batch(chunk: CriteoChunk) -> RecBatch:
    """A :class:`RecBatch` of a chunk: one id per (feature, sample), keys ``cat_0..cat_25``."""
    n = len(chunk)
    values = torch.from_numpy(np.ascontiguousarray(chunk.sparse.T).reshape(-1))
    kjt = KeyedJaggedTensor(
        list(SPARSE_NAMES),
        values,
        lengths=torch.ones(NUM_SPARSE * n, dtype=torch.int64),
        stride=n,
        length_per_key=[n] * NUM_SPARSE,
    )
    dense = torch.from_numpy(np.array(chunk.dense, dtype=np.float32))
    labels = torch.from_numpy(np.array(chunk.labels, dtype=np.float32))
    return RecBatch(dense, kjt, labels)
