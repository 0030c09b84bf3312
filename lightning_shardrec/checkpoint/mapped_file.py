"""A plain checkpoint file read by memory mapping, for a sharded resume.

``torch.load(mmap=True)`` maps a zip-format file instead of reading it: a page is read when
touched and shared between the ranks through the page cache. Each rank then copies only its
rows of each table into its shards (:func:`~lightning_shardrec.checkpoint.load_full_state`
with ``copy=mapped.copy``), a piece at a time, and hands the pages it has copied back
(``madvise(MADV_PAGEOUT)``, which never discards data): a rank's resident memory grows by its
share, not by the whole file.

``madvise`` is reached through :mod:`ctypes` (Python's ``mmap.madvise`` works only on a map Python
made, and torch's map is its own); it is no torch internal. It is kept because without it the pages
a rank has copied stay resident, and resuming would cost every rank the whole file in memory. Where
the call is unavailable (not Linux, an old kernel) nothing is released and the load is still correct.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec._compat import torch as compat

#: the most bytes copied between two page releases
PIECE_BYTES = 64 * 2**20
_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages; clean file pages are dropped, nothing is lost


def mappable(path: Any) -> bool:
    """Whether ``path`` is a local zip-format ``torch.save`` file (what ``torch.load(mmap=True)`` takes)."""
    if not isinstance(path, (str, Path)) or "://" in str(path):
        return False
    return Path(path).is_file() and zipfile.is_zipfile(path)


class MappedFile:
    """The tensors of one memory-mapped checkpoint, by storage, to copy from and release."""

    def __init__(self, checkpoint: Any) -> None:
        tensors = [t for t in compat.tree_leaves(checkpoint) if isinstance(t, Tensor)]
        self._storages = {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}

    def mapped(self, t: Tensor) -> bool:
        """Whether ``t`` lies in the mapped file."""
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._storages

    def copy(self, dest: Tensor, source: Tensor) -> None:
        """``dest.copy_(source)`` in row pieces of at most :data:`PIECE_BYTES`, each piece's pages of
        ``source`` released once copied (when ``source`` lies in the mapped file)."""
        if not self.mapped(source) or source.dim() == 0 or dest.shape != source.shape:
            dest.copy_(source)
            return
        row = max(1, math.prod(source.shape[1:]) * source.element_size())
        step = max(1, PIECE_BYTES // row)
        previous = 0
        for start in range(0, source.shape[0], step):
            dest[start : start + step].copy_(source[start : start + step])
            # this piece and the one before: the page cache's large folios (up to 2 MiB) are handed back
            # only whole, and one that straddles two pieces is whole once both are copied
            release(source[previous : start + step])
            previous = start

    def owned(self, value: Any) -> Any:
        """``value`` with every tensor that lies in the mapped file cloned (kept past the load)."""
        return compat.tree_map(lambda t: t.clone() if isinstance(t, Tensor) and self.mapped(t) else t, value)


def load_mapped(path: str | Path, weights_only: bool) -> tuple[Any, MappedFile]:
    """``torch.load`` of a zip-format file, memory-mapped onto the CPU; and what was mapped.

    The file is flushed first: the pages of a file just written are dirty, and a dirty page is
    not handed back until it has been written out.
    """
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    return checkpoint, MappedFile(checkpoint)


def release(t: Tensor) -> None:
    """Hand the whole pages under ``t`` (a CPU tensor) back to the kernel without losing data (Linux;
    elsewhere, or on a kernel without ``MADV_PAGEOUT``, nothing)."""
    if _libc is None or t.numel() == 0:
        return
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    start, end = t.data_ptr(), t.data_ptr() + span * t.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _libc.madvise(first, last - first, _MADV_PAGEOUT)  # an error (old kernel) leaves the pages: still correct


def _load_libc() -> Any:
    """The C library's ``madvise`` (Linux only: ``MADV_PAGEOUT`` is Linux's)."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc is loaded already
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_libc = _load_libc()
