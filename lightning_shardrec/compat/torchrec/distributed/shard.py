"""Sharding without ``DistributedModelParallel``, at TorchRec's path (``torchrec.distributed.shard``).

* :func:`shard`: one collection replaced by its sharded variant, from a module plan (``{table:
  ParameterSharding}``), a dict of per-table generators, or one generator for every table::

      sharded_ebc = shard(ebc, table_row_wise(host_index=0))

* :func:`shard_modules` (and TorchRec's ``_shard_modules``): every collection of a module, see
  :mod:`lightning_shardrec.distributed.dmp.shard`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_shardrec.compat.torchrec.distributed.sharding_plan import ParameterShardingGenerator, _sharder_for
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.local_ranks import get_local_size
from lightning_shardrec.distributed.dmp.shard import _shard_modules, shard_collection, shard_modules
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder
from lightning_shardrec.planner import ParameterSharding

ModulePlan = Mapping[str, ParameterSharding | ParameterShardingGenerator]


def shard(
    module: nn.Module,
    plan: ModulePlan | ParameterShardingGenerator,
    env: ShardingEnv | None = None,
    device: torch.device | str | None = None,
    sharder: ModuleSharder[Any] | None = None,
) -> nn.Module:
    """``module`` (an embedding collection) sharded as ``plan`` and returned; the rest of a model is untouched.

    A generator (``table_wise(rank=1)``, ``row_wise()``, ...) is run per table with TorchRec's arguments
    (the parameter, ``get_local_size(world)``, the world size, the device type, the sharder). ``env``
    defaults to the default process group; ``device`` to the current CUDA device, else the CPU (TorchRec's
    defaults); ``sharder`` to the default sharder of the module's type.
    """
    found = _sharder_for(module, sharder)
    env = env if env is not None else ShardingEnv.from_process_group()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    per_table = plan if isinstance(plan, Mapping) else dict.fromkeys(found.shardable_parameters(module), plan)
    params = found.shardable_parameters(module)
    unknown = sorted(set(per_table) - set(params))
    if unknown:
        raise ValueError(f"shard: the plan names tables {unknown} that the module does not have ({sorted(params)})")
    local, world = get_local_size(env.world_size), env.world_size
    shardings = {
        name: s if isinstance(s, ParameterSharding) else s(params[name], local, world, device.type, found)
        for name, s in per_table.items()
    }
    return found.shard(module, shardings, env, device)


__all__ = ["_shard_modules", "shard", "shard_collection", "shard_modules"]
