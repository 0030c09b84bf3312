"""Per-table options: which sharding types apply, and their cost/storage as affine functions.

Every cost and storage term is affine in a shard's column count (``f = 1``) and in
its row count (full width), so the partitioner can size a shard to fill a rank's
remaining time and memory in closed form.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_shardrec.planner.costs.perf import Workload, shard_perf
from lightning_shardrec.planner.costs.storage import STORAGE, shard_storage
from lightning_shardrec.planner.plans.tables import COLUMN_ALIGN, NARROW_FROM_RANKS, TableSpec
from lightning_shardrec.planner.plans.types import EmbeddingComputeKernel, ShardingType

# data_parallel is chosen automatically only for tables this small (share of one rank's memory).
DP_MAX_SHARE_OF_MEMORY = 0.01

_FUSED_TYPES = (
    ShardingType.TABLE_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.ROW_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.GRID_SHARD,
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
class GridPiece:
    """One column piece of a grid cut: ``width`` columns from ``col0``, row-blocked in one host."""

    col0: int
    width: int
    cost: Affine  # x = rows of a block
    mem: Affine


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
    grid_cuts: tuple[tuple[GridPiece, ...], ...]  # column cuts a grid_shard may use
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
    fn: object, table: TableSpec, work: Workload, kind: ShardingType, by_rows: bool, width: int = 0
) -> Affine:
    """``fn`` as an affine function of a shard's rows (``width`` columns, default all) or columns."""
    width = width or table.dim

    def at(x: int) -> float:
        rows, cols = (x, width) if by_rows else (table.rows, x)
        return fn(table, work, kind, rows, cols)  # type: ignore[operator]

    one = table.rows if by_rows else table.dim
    fixed = at(0)
    return Affine(fixed=fixed, slope=(at(one) - fixed) / one)


def column_cuts(dim: int, min_partition: int) -> list[list[int]]:
    """Widths of grid column cuts: the most pieces ``min_partition`` allows, then halving, down to 2.

    Pieces are near-equal and multiples of 4 when ``dim`` is (``[32, 32, 32, 32]`` for 128 / 32).
    """
    unit = COLUMN_ALIGN if dim % COLUMN_ALIGN == 0 and min_partition % COLUMN_ALIGN == 0 else 1
    units = dim // unit
    most = min(dim // min_partition, units)
    cuts: list[list[int]] = []
    k = most
    while k >= 2:
        base, extra = divmod(units, k)
        cuts.append([(base + (i < extra)) * unit for i in range(k)])
        k //= 2
    return cuts


def _grid_cuts(table: TableSpec, work: Workload) -> tuple[tuple[GridPiece, ...], ...]:
    cuts = []
    for widths in column_cuts(table.dim, table.min_partition):
        affines = {
            w: (
                _affine(shard_perf, table, work, ShardingType.GRID_SHARD, True, w),
                _affine(_storage_float, table, work, ShardingType.GRID_SHARD, True, w),
            )
            for w in set(widths)
        }
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        cuts.append(
            tuple(
                GridPiece(col0=c, width=w, cost=affines[w][0], mem=affines[w][1])
                for c, w in zip(offsets, widths, strict=True)
            )
        )
    return tuple(cuts)


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
    grid_cuts = _grid_cuts(table, work) if ShardingType.GRID_SHARD in kinds else ()
    if not grid_cuts:  # fewer than 2 * min_partition columns: no column cut to row-block
        kinds = [k for k in kinds if k is not ShardingType.GRID_SHARD]
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
        grid_cuts=grid_cuts,
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


SHARD_ONE_MORE_UP_TO = 256  # ranks; past this one more partition costs seconds of planning


def next_to_shard(opts: list[TableOptions], memory_cap: int, world_size: int) -> TableOptions | None:
    """The table replicated by choice that is nearest to being sharded (the largest ``dp_cost * W /
    tw_cost``), to try sharded from ``NARROW_FROM_RANKS`` to :data:`SHARD_ONE_MORE_UP_TO` ranks; ``None``
    outside them or where no table is replicated by choice. Shards are a multiple of 4 columns wide, so
    one more sharded table can level the ranks: 64 GPUs of Criteo-1TB hold 12 tables as 24 columns per
    rank, where 11 tables' 1,408 columns are 22 per rank, which no aligned cut levels."""
    if not NARROW_FROM_RANKS <= world_size <= SHARD_ONE_MORE_UP_TO:
        return None
    chosen = [o for o in opts if prefers_data_parallel(o, memory_cap) and len(o.kinds) > 1 and o.tw_cost > 0]
    return max(chosen, key=lambda o: (o.dp_cost * o.world_size / o.tw_cost, o.table.key), default=None)
