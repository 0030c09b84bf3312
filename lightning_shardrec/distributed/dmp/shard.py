"""Sharding without ``DistributedModelParallel``, at TorchRec's path (``torchrec.distributed.shard``).

* :func:`shard_collection` (from :mod:`.shardable`): one collection and its table shardings -> the sharded
  collection (what ``EmbeddingBagCollectionSharder().shard(ebc, plan.plan[""], env, device)`` runs);
* :func:`shard_modules` (TorchRec's ``shard_modules`` / ``_shard_modules``): every collection of a
  module, planned (collectively) when no plan is given, swapped in place; the module is returned.

The sharded collection carries its fused optimizer as ``fused_optimizer`` (a
:class:`~lightning_shardrec.optim.FusedOptimizer`), as TorchRec's sharded modules do. The dense rest of
the module is left as it is (no DDP: that is ``DistributedModelParallel``'s job).

Quantized collections (:mod:`lightning_shardrec.inference`) are not sharded here: they serve whole on
each process, which on one rank is what TorchRec's one-rank sharded quantized collection computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.dmp.shardable import find_collections, shard_collection
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder, check_sharders
from lightning_shardrec.planner import EmbeddingShardingPlanner, ShardingPlan, Topology


def shard_modules(
    module: nn.Module,
    env: ShardingEnv | None = None,
    device: torch.device | str | None = None,
    plan: ShardingPlan | None = None,
    sharders: Sequence[ModuleSharder[Any]] | None = None,
    init_params: bool = False,
) -> nn.Module:
    """Every embedding collection of ``module`` sharded in place (``module`` itself when it is one, then
    the sharded collection is returned). Without ``plan`` the tables are planned for ``env``'s group
    (a collective). ``init_params`` is accepted for TorchRec's signature: tables built on ``meta`` are
    always initialised here (from the collection's seeds), so it changes nothing."""
    env = env if env is not None else ShardingEnv.from_process_group(dist.group.WORLD)
    checked = check_sharders(sharders, "shard_modules")
    collections = find_collections(module)
    if plan is None and collections:
        topology = Topology.from_process_group(env.pg, local_world_size=env.local_world_size)
        plan = EmbeddingShardingPlanner(topology).collective_plan(module, checked, env.pg)
    out = module
    for path, coll in collections.items():
        tables = plan.get_plan_for_module(path) if plan is not None else None
        if tables is None:
            raise ValueError(f"shard_modules: the sharding plan has no entry for module '{path or '<root>'}'")
        new = shard_collection(coll, tables, env, device, checked, f"shard_modules ('{path or '<root>'}')")
        if not path:
            out = new
            continue
        parent, _, leaf = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, leaf, new)
    if device is not None and out is module:
        module.to(torch.device(device))
    return out


#: TorchRec's own name for the same function (its public ``shard_modules`` calls it)
_shard_modules = shard_modules

__all__ = ["shard_collection", "shard_modules"]
