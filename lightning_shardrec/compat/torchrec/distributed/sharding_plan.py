"""TorchRec's hand-written plan helpers (``torchrec.distributed.sharding_plan``).

::

    plan = construct_module_sharding_plan(ebc, {
        "t_user": row_wise(),              # ceil(rows / W) rows per rank, in rank order
        "t_item": table_wise(rank=1),      # the whole table on rank 1
        "t_ad":   column_wise(ranks=[0, 1]),  # dim split evenly over the ranks given
        "t_tiny": data_parallel(),         # a full copy per rank, stepped by the dense optimizer
    }, world_size=2, local_size=2, device_type="cpu")
    model = DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}))

The shard sizes and offsets are TorchRec's (``calculate_shard_sizes_and_offsets``). A table that is
not ``data_parallel`` gets the ``fused`` kernel: this library has no sharded kernel stepped by the
dense optimizer (TorchRec's ``dense``), so such a table trains with the model's fused optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_shardrec.distributed.comm.local_ranks import get_local_size
from lightning_shardrec.distributed.dmp.sharders import (
    ModuleSharder,
    get_default_sharders,
    get_module_to_default_sharders,
)
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)

#: (parameter, local_size, world_size, device_type, sharder) -> its sharding
ParameterShardingGenerator = Callable[[nn.Parameter, int, int, str, ModuleSharder[Any]], ParameterSharding]
#: TorchRec's ``MIN_CW_DIM``: the smallest column block ``column_wise`` cuts without ``ranks``
MIN_CW_DIM = 128
Sizes = list[list[int]]


def placement(compute_device: str, rank: int, local_size: int) -> str:
    """``"rank:3/cuda:1"`` (a GPU per local rank) or ``"rank:3/cpu"``."""
    device = f"{compute_device}:{rank % local_size}" if compute_device in {"cuda", "mtia"} else compute_device
    return f"rank:{rank}/{device}"


def _rw(rows: int, devices: int, cols: int) -> tuple[Sizes, Sizes]:
    """``ceil(rows / devices)`` rows per device in order, the rest on the next, 0 after (10 on 4: 3, 3, 3, 1)."""
    block = math.ceil(rows / devices)
    sizes = [[min(block, max(rows - block * r, 0)), cols] for r in range(devices)]
    offsets = [[sum(s[0] for s in sizes[:r]), 0] for r in range(devices)]
    return sizes, offsets


def _block_size(cols: int, shard_dim: int | None) -> int:
    lower = shard_dim or MIN_CW_DIM
    block = next((i for i in range(lower, cols) if cols % i == 0 and i % 4 == 0), cols)
    return min(block, cols) if cols % min(block, cols) == 0 else cols


def calculate_shard_sizes_and_offsets(
    tensor: torch.Tensor,
    world_size: int,
    local_world_size: int,
    sharding_type: str,
    col_wise_shard_dim: int | None = None,
) -> tuple[Sizes, Sizes]:
    """TorchRec's shard sizes and offsets of ``tensor`` ``[rows, cols]`` for ``sharding_type``."""
    rows, cols = tensor.shape
    kind = ShardingType(getattr(sharding_type, "value", sharding_type))
    if kind is ShardingType.DATA_PARALLEL:
        return [[rows, cols]] * world_size, [[0, 0]] * world_size
    if kind is ShardingType.TABLE_WISE:
        return [[rows, cols]], [[0, 0]]
    if kind is ShardingType.ROW_WISE:
        return _rw(rows, world_size, cols)
    if kind is ShardingType.TABLE_ROW_WISE:
        return _rw(rows, local_world_size, cols)
    block = _block_size(cols, col_wise_shard_dim)
    if kind is ShardingType.COLUMN_WISE:
        n = cols // block
        return [[rows, block]] * n, [[0, block * i] for i in range(n)]
    sizes, offsets = _rw(rows, local_world_size, cols)  # grid: row blocks per host, then column blocks
    return (
        [[s[0], block] for _ in range(cols // block) for s in sizes],
        [[o[0], block * c] for c in range(cols // block) for o in offsets],
    )


def _sharding(
    kind: ShardingType, parts: list[tuple[list[int], list[int], int]], kernel: str | None
) -> ParameterSharding:
    default = EmbeddingComputeKernel.DENSE if kind is ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED
    return ParameterSharding(
        sharding_type=kind.value,
        compute_kernel=kernel or default.value,
        ranks=[r for *_, r in parts],
        shards=[ShardMetadata(shard_offsets=o, shard_sizes=s, rank=r) for s, o, r in parts],
    )


def data_parallel() -> ParameterShardingGenerator:
    """A full copy of the table on every rank."""

    def generate(param: nn.Parameter, local: int, world: int, device: str, sharder: Any) -> ParameterSharding:
        sizes, offsets = calculate_shard_sizes_and_offsets(param, world, local, "data_parallel")
        return _sharding(
            ShardingType.DATA_PARALLEL, [(s, o, r) for r, (s, o) in enumerate(zip(sizes, offsets, strict=True))], None
        )

    return generate


def table_wise(rank: int, device: str | None = None, compute_kernel: str | None = None) -> ParameterShardingGenerator:
    """The whole table on ``rank``."""

    def generate(param: nn.Parameter, local: int, world: int, device_type: str, sharder: Any) -> ParameterSharding:
        if not 0 <= rank < world:
            raise ValueError(f"table_wise(rank={rank}): the rank must be in [0, {world})")
        return _sharding(ShardingType.TABLE_WISE, [(list(param.shape), [0, 0], rank)], compute_kernel)

    return generate


def row_wise(
    sizes_placement: tuple[list[int], str | list[str]] | None = None,
    compute_kernel: str | None = None,
    num_buckets: int | None = None,
) -> ParameterShardingGenerator:
    """``ceil(rows / world)`` rows per rank, in rank order."""
    for name, value in (("sizes_placement", sizes_placement), ("num_buckets", num_buckets)):
        if value is not None:
            raise UnsupportedFeatureError(
                f"row_wise({name}={value!r}) is not supported: uneven row splits are TorchRec's inference "
                "placement, buckets its managed-collision tables (see docs/migrating.md, 'Planner')"
            )

    def generate(param: nn.Parameter, local: int, world: int, device: str, sharder: Any) -> ParameterSharding:
        sizes, offsets = calculate_shard_sizes_and_offsets(param, world, local, "row_wise")
        return _sharding(
            ShardingType.ROW_WISE,
            [(s, o, r) for r, (s, o) in enumerate(zip(sizes, offsets, strict=True))],
            compute_kernel,
        )

    return generate


def column_wise(
    ranks: list[int] | None = None,
    size_per_rank: list[int] | None = None,
    compute_kernel: str | None = None,
    device_types: list[str] | None = None,
) -> ParameterShardingGenerator:
    """The dim split evenly over ``ranks`` (a rank may repeat), or ``size_per_rank[i]`` columns on rank ``i``."""
    if ranks is None and size_per_rank is None:
        raise ValueError("column_wise: give ranks= (an even split over them) or size_per_rank= (columns per rank)")
    if device_types is not None:
        raise UnsupportedFeatureError(
            f"column_wise(device_types={device_types!r}) is not supported: every shard of a table lives on "
            "its rank's training device here (see docs/migrating.md, 'Planner')"
        )

    def generate(param: nn.Parameter, local: int, world: int, device: str, sharder: Any) -> ParameterSharding:
        rows, cols = param.shape
        if size_per_rank is None:
            assert ranks is not None
            if cols % len(ranks):
                raise ValueError(f"column dim of {cols} cannot be evenly divided across {ranks}")
            sizes, offsets = calculate_shard_sizes_and_offsets(param, world, local, "column_wise", cols // len(ranks))
            parts = [
                (s, o, r) for (s, o), r in zip(zip(sizes, offsets, strict=True), ranks, strict=False)
            ]  # TorchRec's
        else:
            parts, start = [], 0
            for rank, size in enumerate(size_per_rank):
                end = min(start + size, cols)
                parts.append(([rows, end - start], [0, start], rank))
                start = end
            if start < cols:
                raise ValueError(f"Cannot fit tensor of {(rows, cols)} into sizes_ranks_placements = {size_per_rank}")
        return _sharding(ShardingType.COLUMN_WISE, parts, compute_kernel)

    return generate


def table_row_wise(host_index: int) -> ParameterShardingGenerator:
    """Row-wise over the ranks of host ``host_index`` (``local_size`` ranks per host)."""

    def generate(param: nn.Parameter, local: int, world: int, device: str, sharder: Any) -> ParameterSharding:
        sizes, offsets = calculate_shard_sizes_and_offsets(param, world, local, "table_row_wise")
        parts = [(s, o, host_index * local + r) for r, (s, o) in enumerate(zip(sizes, offsets, strict=True))]
        return _sharding(ShardingType.TABLE_ROW_WISE, parts, None)

    return generate


def grid_shard(host_indexes: list[int]) -> ParameterShardingGenerator:
    """Column blocks, one per host of ``host_indexes``, each row-wise over that host's ranks."""

    def generate(param: nn.Parameter, local: int, world: int, device: str, sharder: Any) -> ParameterSharding:
        sizes, offsets = calculate_shard_sizes_and_offsets(param, world, local, "grid_shard")
        parts = []
        for n, host in enumerate(host_indexes):
            for r in range(local):
                i = n * local + r
                parts.append((sizes[i], offsets[i], host * local + r))
        return _sharding(ShardingType.GRID_SHARD, parts, None)

    return generate


def get_sharding_constructor_from_type(sharding_type: ShardingType) -> Callable[..., ParameterShardingGenerator]:
    constructors: dict[ShardingType, Callable[..., ParameterShardingGenerator]] = {
        ShardingType.TABLE_WISE: table_wise,
        ShardingType.ROW_WISE: row_wise,
        ShardingType.COLUMN_WISE: column_wise,
        ShardingType.TABLE_ROW_WISE: table_row_wise,
        ShardingType.GRID_SHARD: grid_shard,
        ShardingType.DATA_PARALLEL: data_parallel,
    }
    return constructors[ShardingType(getattr(sharding_type, "value", sharding_type))]


def _sharder_for(module: nn.Module, sharder: ModuleSharder[Any] | None) -> ModuleSharder[Any]:
    found = sharder or get_module_to_default_sharders().get(type(module))
    if found is None:
        known = ", ".join(t.__name__ for t in get_module_to_default_sharders())
        raise ValueError(f"no sharder for module type {type(module).__name__}; the default sharders cover {known}")
    if not isinstance(module, found.module_type):
        raise ValueError(
            f"sharder {type(found).__name__} shards {found.module_type.__name__}, not {type(module).__name__}"
        )
    return found


def apply_to_all(
    module: nn.Module,
    parameter_sharding_generator: ParameterShardingGenerator,
    sharder: ModuleSharder[Any] | None = None,
) -> dict[str, ParameterShardingGenerator]:
    """``{table: parameter_sharding_generator}`` for every table of ``module``."""
    return {name: parameter_sharding_generator for name in _sharder_for(module, sharder).shardable_parameters(module)}


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ParameterShardingGenerator],
    sharder: ModuleSharder[Any] | None = None,
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> EmbeddingModuleShardingPlan:
    """``{table: ParameterSharding}`` of ``module`` (every table named once), for ``ShardingPlan({path: ...})``."""
    found = _sharder_for(module, sharder)
    params = found.shardable_parameters(module)
    if set(params) != set(per_param_sharding):
        raise ValueError(
            "per_param_sharding_config doesn't match the shardable parameters of the module, "
            f"got {sorted(params)} != {sorted(per_param_sharding)}"
        )
    world = world_size or dist.get_world_size()
    local = local_size or get_local_size(world)
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return EmbeddingModuleShardingPlan(
        {name: generate(params[name], local, world, device, found) for name, generate in per_param_sharding.items()}
    )


__all__ = [
    "ParameterShardingGenerator",
    "apply_to_all",
    "calculate_shard_sizes_and_offsets",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "get_sharding_constructor_from_type",
    "grid_shard",
    "placement",
    "row_wise",
    "table_row_wise",
    "table_wise",
]
