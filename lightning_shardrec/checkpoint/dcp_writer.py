"""DCP's file writer for a sharded save, chosen so a rank's host copies of its pieces stay bounded.

``FileSystemWriter`` (torch 2.13, ``torch/distributed/checkpoint/filesystem.py``) writes every
item of a rank's file from the loader (``_SerialCpuLoader`` / ``_OverlappingCpuLoader``), which
hands it a host tensor: a GPU tensor's ``.cpu()`` copy, a clone of a CPU view whose storage is
larger than itself, or the CPU tensor itself. ``_write_files_from_queue`` keeps every tensor it
wrote in ``tensor_dict`` (used only by the safetensors format) until the file is closed. With one
file per rank (its default) a rank therefore holds a host copy of every such piece, its whole share,
until its last piece is written. With one file per item (``single_file_per_rank=False``) each copy
is dropped when its file closes: at most one piece per writing thread (pieces are at most
:data:`~lightning_shardrec.checkpoint.sharded_state.PIECE_BYTES`).

CPU shards are handed over with their own storage (:func:`~.sharded_state.own_storage`): nothing
is copied and one file per rank is kept. One file per item is chosen only when a local tensor
would be copied: on GPUs, or for a CPU view DCP clones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter

from lightning_shardrec._compat import torch as compat


def _local_tensors(state: Any) -> Iterator[Tensor]:
    """Every tensor this rank writes from ``state``: plain tensors and ShardedTensors' local shards, nested."""
    if compat.is_sharded_tensor(state):
        yield from (shard.tensor for shard in state.local_shards())
    elif isinstance(state, Tensor):
        yield state
    elif isinstance(state, Mapping):
        for value in state.values():
            yield from _local_tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _local_tensors(value)


def copied_by_dcp(t: Tensor) -> bool:
    """Whether DCP's writer makes a host copy of ``t``: off the host, or a view with more storage than itself."""
    return t.device.type != "cpu" or t.untyped_storage().nbytes() != t.numel() * t.element_size()


def storage_writer(path: str | Path, state: Mapping[str, Any]) -> FileSystemWriter:
    """The writer for ``state`` into directory ``path``: one file per item if any local tensor would be copied."""
    per_item = any(copied_by_dcp(t) for t in _local_tensors(state))
    return FileSystemWriter(path, single_file_per_rank=not per_item)
