"""Per-table options: which sharding types apply, and their cost/storage as affine functions.

Every cost and storage term is affine in a shard's column count (``f = 1``) and in
its row count (full width), so the partitioner can size a shard to fill a rank's
remaining time and memory in closed form.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_shardrec.planner.perf import Workload, shard_perf
from lightning_shardrec.planner.storage import STORAGE, shard_storage
from lightning_shardrec.planner.tables import TableSpec
from lightning_shardrec.planner.types import EmbeddingComputeKernel, ShardingType

# data_parallel is chosen automatically only for tables this small (share of one rank's memory).
DP_MAX_SHARE_OF_MEMORY = 0.01

_FUSED_TYPES = (
    ShardingType.TABLE_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.ROW_WISE,
    ShardingType.TABLE_ROW_WISE,
)


@dataclass(frozen=True, kw_only=True)
class Affine:
    """``fixed + slope * x``: cost (seconds) or storage (bytes) of a shard of size ``x``."""

    fixed: float
    slope: float

    def at(self, x: float) -> float:
        return self.fixed + self.slope * x

    def largest_within(self, budget: float) -> float:
        """The largest ``x`` with ``at(x) <= budget`` (``-1`` when even ``x = 0`` is over)."""
        if budget < self.fixed:
            return -1.0
        return float("inf") if self.slope <= 0 else (budget - self.fixed) / self.slope


@dataclass(frozen=True, kw_only=True)
class TableOptions:
    """A table, the sharding types it may use, and their cost curves."""

    table: TableSpec
    kinds: tuple[ShardingType, ...]
    tw_cost: float
    tw_mem: int
    dp_cost: float
    dp_mem: int
    col_cost: Affine  # column shard, x = cols
    col_mem: Affine
    row_cost: dict[ShardingType, Affine]  # row_wise / table_row_wise block, x = rows
    row_mem: dict[ShardingType, Affine]
    world_size: int

    def allows(self, kind: ShardingType) -> bool:
        return kind in self.kinds

    @property
    def cheapest_total(self) -> float:
        """The least total work any arrangement of this table costs (for the lower bound)."""
        totals = [self.tw_cost] if any(k in _FUSED_TYPES for k in self.kinds) else []
        if self.allows(ShardingType.DATA_PARALLEL):
            totals.append(self.dp_cost * self.world_size)
        return min(totals)


def _affine(
    fn: object, table: TableSpec, work: Workload, kind: ShardingType, by_rows: bool
) -> Affine:
    def at(x: int) -> float:
        rows, cols = (x, table.dim) if by_rows else (table.rows, x)
        return fn(table, work, kind, rows, cols)  # type: ignore[operator]

    one = table.rows if by_rows else table.dim
    fixed = at(0)
    return Affine(fixed=fixed, slope=(at(one) - fixed) / one)


def _storage_float(
    table: TableSpec, work: Workload, kind: ShardingType, rows: int, cols: int
) -> float:
    return STORAGE[kind](table, work, rows, cols)


def table_options(table: TableSpec, work: Workload) -> TableOptions:
    """The sharding types ``table`` may use and their cost curves under ``work``."""
    kinds = list(table.sharding_types)
    if EmbeddingComputeKernel.FUSED not in table.compute_kernels:
        kinds = [k for k in kinds if k is ShardingType.DATA_PARALLEL]
    if EmbeddingComputeKernel.DENSE not in table.compute_kernels or (
        table.ranks is not None and len(table.ranks) < work.topology.world_size
    ):
        kinds = [k for k in kinds if k is not ShardingType.DATA_PARALLEL]
    rows, dim = table.rows, table.dim
    row_kinds = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
    return TableOptions(
        table=table,
        kinds=tuple(kinds),
        tw_cost=shard_perf(table, work, ShardingType.TABLE_WISE, rows, dim),
        tw_mem=shard_storage(table, work, ShardingType.TABLE_WISE, rows, dim),
        dp_cost=shard_perf(table, work, ShardingType.DATA_PARALLEL, rows, dim),
        dp_mem=shard_storage(table, work, ShardingType.DATA_PARALLEL, rows, dim),
        col_cost=_affine(shard_perf, table, work, ShardingType.COLUMN_WISE, by_rows=False),
        col_mem=_affine(_storage_float, table, work, ShardingType.COLUMN_WISE, by_rows=False),
        row_cost={k: _affine(shard_perf, table, work, k, by_rows=True) for k in row_kinds},
        row_mem={k: _affine(_storage_float, table, work, k, by_rows=True) for k in row_kinds},
        world_size=work.topology.world_size,
    )


def prefers_data_parallel(opt: TableOptions, memory_cap: int) -> bool:
    """Data-parallel when it is the only choice, or small and cheaper in total than any cut."""
    if not opt.allows(ShardingType.DATA_PARALLEL):
        return False
    if all(k is ShardingType.DATA_PARALLEL for k in opt.kinds):
        return True
    small = opt.dp_mem <= DP_MAX_SHARE_OF_MEMORY * memory_cap
    return small and opt.dp_cost * opt.world_size < opt.tw_cost
