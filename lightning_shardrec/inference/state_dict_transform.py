"""Moving and gathering sharded state dicts, at TorchRec's path (``torchrec.inference.state_dict_transform``).

They work on ``DistributedModelParallel.state_dict()``, whose sharded tables are torch
``ShardedTensor`` s (every rank has every key, a table-wise table with no local shard included):

* :func:`state_dict_to_device`: the same state dict with every tensor (and every local shard) on
  ``device``; collective over ``pg``.
* :func:`state_dict_gather`: copy a source state dict into ``dst``'s tensors, sharded tables
  gathered whole into rank 0's tensor; collective (the gathers) over the default group.
* :func:`state_dict_all_gather_keys`: the union of every rank's keys, sorted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec._compat import torch as compat

if TYPE_CHECKING:
    from lightning_shardrec._compat.torch import ShardedTensor


def state_dict_gather(src: Mapping[str, Tensor | ShardedTensor], dst: Mapping[str, Tensor]) -> None:
    """For each key of ``dst``: ``src[key]`` copied in (a ShardedTensor gathered into rank 0's tensor)."""
    for key, out in dst.items():
        value = src[key]
        if compat.is_sharded_tensor(value):
            value.gather(dst=0, out=out if dist.get_rank() == 0 else None, dtype=out.dtype)
        elif isinstance(value, Tensor):
            with torch.no_grad():
                out.copy_(value)
        else:
            raise ValueError(f"state_dict_gather: '{key}' is a {type(value).__name__}, not a tensor or ShardedTensor")


def state_dict_all_gather_keys(state_dict: Mapping[str, object], pg: dist.ProcessGroup | None) -> list[str]:
    """Every rank's keys, deduplicated and sorted (collective over ``pg``)."""
    every: list[list[str] | None] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(every, list(state_dict), group=pg)
    return sorted({k for keys in every for k in keys or []})


def state_dict_to_device(
    state_dict: Mapping[str, Tensor | ShardedTensor], pg: dist.ProcessGroup | None, device: torch.device
) -> dict[str, Tensor | ShardedTensor]:
    """``state_dict`` with its tensors and local shards on ``device`` (collective over ``pg``)."""
    out: dict[str, Tensor | ShardedTensor] = {}
    rank = dist.get_rank(pg)
    for key in state_dict_all_gather_keys(state_dict, pg):
        value = state_dict.get(key)
        if compat.is_sharded_tensor(value):
            shards = [(s.tensor.to(device), s.metadata.shard_offsets) for s in value.local_shards()]
            out[key] = compat.sharded_tensor_from_local(shards, value.metadata().size, rank, pg)
        elif isinstance(value, Tensor):
            out[key] = value.to(device)
        elif value is None:  # a key another rank has: join the collective with no shard
            out[key] = compat.sharded_tensor_from_local([], [], rank, pg)
        else:
            raise ValueError(f"state_dict_to_device: '{key}' is a {type(value).__name__}, not a tensor")
    return out


__all__ = ["state_dict_all_gather_keys", "state_dict_gather", "state_dict_to_device"]
