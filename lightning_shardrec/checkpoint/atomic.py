"""Atomic checkpoints: write beside the target, rename into place once every rank has finished.

A save writes into a hidden staging path next to the target (``.<name>.tmp-<token>``,
one token agreed by all ranks), and only after *every* rank reports success does rank
0 swap it in: the old checkpoint is renamed aside (``.<name>.old-<token>``), the new
one renamed in, the old one deleted. A crash before the swap leaves the previous
checkpoint untouched at its path (and a stale staging path, removed by the next save
to that path); a crash between the two renames leaves the previous checkpoint aside,
and :func:`recover_interrupted` (called by every save and load) renames it back.
Hidden names never match ``ModelCheckpoint``'s ``*.ckpt`` / ``last*.ckpt`` patterns.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

TMP_TAG = ".tmp-"
OLD_TAG = ".old-"
DEL_TAG = ".del-"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_token() -> str:
    """Collective: a fresh token, the same on every rank (rank 0's)."""
    box = [uuid.uuid4().hex[:12]]
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def sync() -> None:
    """Collective: a barrier (nothing without a process group)."""
    if _distributed():
        dist.barrier()


def describe(error: BaseException) -> list[str]:
    """``"rank r: Type: message"`` lines for ``error`` (DCP's ``CheckpointException`` names its failed ranks)."""
    if isinstance(error, CheckpointException):
        return [f"rank {r}: {_short(e)}" for r, (e, _) in sorted(error.failures.items())]
    rank = dist.get_rank() if _distributed() else 0
    return [f"rank {rank}: {_short(error)}"]


def _short(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agree_failures(error: BaseException | None) -> list[str]:
    """Collective: the :func:`describe` lines of every rank's ``error`` (empty: every rank succeeded)."""
    mine = [] if error is None else describe(error)
    if not _distributed():
        return mine
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return list(dict.fromkeys(line for lines in everyone for line in lines or []))


def staging_path(path: Path, token: str) -> Path:
    """Where a save to ``path`` writes before the swap."""
    return path.with_name(f".{path.name}{TMP_TAG}{token}")


def _siblings(path: Path, tag: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    prefix = f".{path.name}{tag}"
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix))


def remove_path(path: Path) -> None:
    """Delete a file, a symlink (not its target) or a directory tree; nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def discard(path: Path) -> None:
    """Delete a checkpoint without a half-deleted directory ever visible at ``path``."""
    if not (path.exists() or path.is_symlink()):
        return
    aside = path.with_name(f".{path.name}{DEL_TAG}{uuid.uuid4().hex[:12]}")
    os.replace(path, aside)
    remove_path(aside)


def recover_interrupted(path: Path) -> bool:
    """If a swap into ``path`` died between its two renames, put the previous checkpoint back."""
    if path.exists() or path.is_symlink():
        return False
    aside = _siblings(path, OLD_TAG)
    if not aside:
        return False
    newest = max(aside, key=lambda p: p.stat().st_mtime)
    os.replace(newest, path)
    return True


def clean_stale(path: Path, keep: Path | None = None) -> None:
    """Remove what crashed saves to ``path`` left, except ``keep`` (after :func:`recover_interrupted`)."""
    recover_interrupted(path)
    for stale in _siblings(path, TMP_TAG) + _siblings(path, OLD_TAG) + _siblings(path, DEL_TAG):
        if stale != keep:
            remove_path(stale)


def commit(staging: Path, path: Path) -> None:
    """Swap ``staging`` in at ``path`` (a file, symlink or directory there is replaced)."""
    old = None
    if path.exists() or path.is_symlink():
        old = path.with_name(f".{path.name}{OLD_TAG}{staging.name.rsplit(TMP_TAG, 1)[-1]}")
        os.replace(path, old)
    os.replace(staging, path)
    if old is not None:
        remove_path(old)


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` to a staging file beside ``path``, flushed to disk, then swapped in (one process)."""
    staging = staging_path(path, uuid.uuid4().hex[:12])
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path, keep=staging)
    try:
        with open(staging, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        commit(staging, path)
    finally:
        remove_path(staging)
