"""``DistributedModelParallel``'s state dict with the model's own keys, as TorchRec's.

::

    dense parameters and buffers   "<path>"                        plain tensors (DDP's prefix dropped)
    a sharded table                "<coll>.embedding_bags.<t>.weight"  torch ShardedTensor: this rank's shards,
                                   ("<coll>.embeddings.<t>.weight",     global [rows, dim] metadata (TorchRec's
                                    "<emb>.weight" for nn.Embedding)    type; torch.distributed.checkpoint saves it)
    a data_parallel table          same key                         the full (replicated) tensor

:func:`state_dict` is not collective: every rank knows the whole layout from the plan (as under TorchRec,
where a program may read ``dmp.state_dict()`` on one rank while the others wait in a barrier).
:func:`load_state_dict` takes that layout back, or full ``[rows, dim]`` tensors (each rank copies
its slices), so a plain model's state dict loads into the sharded one. :func:`full_state_dict`
(collective) gathers every table whole, on one rank or every rank, in bands by tensor collectives.
Dynamic tables are refused by name: their rows are slots, saved with their id map by
``lightning_shardrec.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.distributed.comm.band_gather import BandGather, LocalTensor
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.errors import ShardedStateError
from lightning_shardrec.planner import ShardingPlan, ShardingType


class ShardedModel(Protocol):
    """What these functions read of a :class:`~lightning_shardrec.distributed.dmp.model_parallel.
    DistributedModelParallel` (which imports this module): its collections, model, plan, env and device."""

    @property
    def sharded(self) -> Mapping[str, Any]: ...

    @property
    def module(self) -> nn.Module: ...

    @property
    def plan(self) -> Any: ...

    @property
    def env(self) -> ShardingEnv: ...

    @property
    def device(self) -> torch.device: ...


class IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _tables(dmp: ShardedModel) -> list[tuple[str, Any, Any, list[tuple[Any, Tensor]]]]:
    """``(key, config, sharding, local shards)`` of every sharded table, in the same order on every rank."""
    out = []
    for path, coll in dmp.sharded.items():
        prefix = f"{path}." if path else ""
        plan = cast(ShardingPlan, dmp.plan).get_plan_for_module(path) or {}
        shards = coll.local_shards()
        for cfg in coll.table_configs():
            key = f"{prefix}{coll.state_key(cfg.name)}"
            if cfg.dynamic is not None:
                raise ShardedStateError(
                    f"DistributedModelParallel.state_dict(): table '{cfg.name}' ({key}) is dynamic: its rows are "
                    "slots of an id map; save and load it with lightning_shardrec.checkpoint "
                    "(see docs/migrating.md, 'State dicts')"
                )
            out.append((key, cfg, plan[cfg.name], shards.get(cfg.name, [])))
    return out


def _dense_keys(dmp: ShardedModel) -> dict[str, Tensor]:
    paths = [p for p in dmp.sharded if p]
    if "" in dmp.sharded:
        return {}
    state = dmp.module.state_dict(keep_vars=True)
    return {k: v for k, v in state.items() if not any(k.startswith(f"{p}.") for p in paths)}


def state_dict(dmp: ShardedModel, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
    """The model's keys; sharded tables as ShardedTensors of this rank's shards. Not collective: the
    global layout comes from the plan every rank holds (as TorchRec's), so one rank may call it alone."""
    out: dict[str, Any] = {}
    for k, v in _dense_keys(dmp).items():
        out[prefix + k] = v if keep_vars else v.detach()
    pg = dmp.env.pg
    tables = _tables(dmp)
    dtypes = [w.dtype for *_, shards in tables for _, w in shards]
    for key, cfg, sharding, shards in tables:
        if sharding.sharding_type is ShardingType.DATA_PARALLEL:
            out[prefix + key] = shards[0][1].detach()
            continue
        dtype = shards[0][1].dtype if shards else (dtypes[0] if dtypes else torch.get_default_dtype())
        out[prefix + key] = _sharded_tensor(pg, cfg, sharding.shards, shards, dtype, dmp.device)
    return out


def _sharded_tensor(
    pg: Any, cfg: Any, layout: Sequence[Any], shards: list[tuple[Any, Tensor]], dtype: torch.dtype, device: Any
) -> Any:
    """This rank's ``shards`` in a ShardedTensor whose global metadata is the plan's ``layout`` (no collective)."""

    def place(m: Any, w: Tensor | None) -> tuple[list[int], list[int], str]:
        rank = dist.get_global_rank(pg, m.rank) if pg is not None else m.rank
        where = w.device if w is not None else torch.device(device)
        return list(m.shard_offsets), list(m.shard_sizes), f"rank:{rank}/{where}"

    mine = {(tuple(m.shard_offsets), tuple(m.shard_sizes)): (m, w.detach().contiguous()) for m, w in shards}
    entries, local = [], {}
    for i, m in enumerate(layout):
        hit = mine.get((tuple(m.shard_offsets), tuple(m.shard_sizes)))
        entries.append(place(m, None) if hit is None else place(hit[0], hit[1]))
        if hit is not None:
            local[i] = hit[1]
    return compat.sharded_tensor_from_layout((cfg.num_embeddings, cfg.embedding_dim), dtype, entries, local, pg)


def load_state_dict(dmp: ShardedModel, state: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Copy ``state`` (this layout, or full tensors for the tables) into the model; not collective."""
    tables = {key: (cfg, shards) for key, cfg, _, shards in _tables(dmp)}
    dense = _dense_keys(dmp)
    missing = sorted(set(tables) - set(state))
    unexpected = sorted(set(state) - set(tables) - set(dense))
    if strict and (missing or unexpected):
        raise KeyError(
            f"DistributedModelParallel.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
        )
    dense_state = {k: v for k, v in state.items() if k in dense}
    if "" not in dmp.sharded:
        result = _load_dense(dmp.module, dense_state, set(dense), strict)
        missing += result
    with torch.no_grad():
        for key, (cfg, shards) in tables.items():
            if key in state:
                _load_table(key, cfg, shards, state[key])
    return IncompatibleKeys(missing, unexpected)


def _load_dense(module: nn.Module, state: dict[str, Any], keys: set[str], strict: bool) -> list[str]:
    missing = sorted(keys - set(state))
    if strict and missing:
        raise KeyError(f"DistributedModelParallel.load_state_dict: missing keys {missing}")
    live = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in state.items():
            if tuple(live[k].shape) != tuple(v.shape):
                raise ValueError(
                    f"DistributedModelParallel.load_state_dict: '{k}' has shape {tuple(v.shape)}, "
                    f"the model's is {tuple(live[k].shape)}"
                )
            live[k].copy_(v)
    return missing


def _load_table(key: str, cfg: Any, shards: list[tuple[Any, Tensor]], value: Any) -> None:
    if compat.is_sharded_tensor(value):
        given = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
        for meta, w in shards:
            src = given.get(tuple(meta.shard_offsets))
            if src is None or tuple(src.shape) != tuple(w.shape):
                raise ValueError(
                    f"DistributedModelParallel.load_state_dict: '{key}' is a ShardedTensor of another layout "
                    f"(no local shard at offsets {tuple(meta.shard_offsets)} of shape {tuple(w.shape)}); pass the "
                    "full tensor (full_state_dict()) or reshard with lightning_shardrec.checkpoint"
                )
            w.copy_(src)
        return
    if tuple(value.shape) != (cfg.num_embeddings, cfg.embedding_dim):
        raise ValueError(
            f"DistributedModelParallel.load_state_dict: '{key}' has shape {tuple(value.shape)}, table "
            f"'{cfg.name}' is [{cfg.num_embeddings}, {cfg.embedding_dim}]"
        )
    for meta, w in shards:
        (r, c), (h, d) = meta.shard_offsets, meta.shard_sizes
        w.copy_(value[r : r + h, c : c + d])


def full_state_dict(dmp: ShardedModel, dst: int | None = None) -> dict[str, Tensor]:
    """Collective: the unsharded model's state dict, every table gathered whole, in host memory.

    On rank ``dst`` of the model's process group (``None``: on every rank; other ranks get
    ``{}``). Tables travel in bands by tensor collectives
    (:class:`~lightning_shardrec.distributed.comm.band_gather.BandGather`): rank ``dst`` holds the
    result and one band, the other ranks their own shards only.
    """
    pg = dmp.env.pg
    tables = _tables(dmp)
    local = [
        LocalTensor(
            group=i,
            name=key,
            shape=(cfg.num_embeddings, cfg.embedding_dim),
            dtype=shards[0][1].dtype if shards else torch.float32,
            pieces=[((m.shard_offsets[0], m.shard_offsets[1]), w.detach()) for m, w in shards],
        )
        for i, (key, cfg, sharding, shards) in enumerate(tables)
        if sharding.sharding_type is not ShardingType.DATA_PARALLEL
    ]
    gathered = {layout.name: full for layout, full in BandGather(local, dst, group=pg).whole()}
    if dst is not None and dist.get_rank(pg) != dst:
        return {}
    out = {k: v.detach().clone() for k, v in _dense_keys(dmp).items()}
    for key, _, sharding, shards in tables:
        if sharding.sharding_type is ShardingType.DATA_PARALLEL:
            out[key] = shards[0][1].detach().cpu().clone()
        else:
            out[key] = gathered.pop(key)
    return out
