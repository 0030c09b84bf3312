"""Check a ``ParameterSharding`` against its table and topology (user-given plans)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_shardrec.planner.machine.topology import Topology
from lightning_shardrec.planner.plans.tables import DYNAMIC_TYPES, TableSpec
from lightning_shardrec.planner.plans.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)


def _one_full_shard(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    if len(ps.shards) != 1:
        return [f"table_wise needs exactly one shard, got {len(ps.shards)}"]
    s = ps.shards[0]
    if s.shard_offsets != (0, 0) or s.shard_sizes != (t.rows, t.dim):
        return [
            f"table_wise shard must be offsets (0, 0) sizes ({t.rows}, {t.dim}), got {s.shard_offsets} {s.shard_sizes}"
        ]
    return []


def _columns(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    col = 0
    for i, s in enumerate(ps.shards):
        if s.shard_offsets != (0, col) or s.shard_sizes[0] != t.rows or s.shard_sizes[1] <= 0:
            return [
                f"column_wise shard {i} must start at (0, {col}) with {t.rows} rows and > 0 columns, "
                f"got offsets {s.shard_offsets} sizes {s.shard_sizes}"
            ]
        col += s.shard_sizes[1]
    if col != t.dim:
        return [f"column_wise shards cover {col} columns, the table has {t.dim}"]
    return []


def _row_blocks(
    t: TableSpec, shards: Sequence[ShardMetadata], kind: str, col0: int, width: int
) -> list[str]:
    """Blocks that tile all rows of columns ``[col0, col0 + width)`` in order, on distinct ranks."""
    row = 0
    for i, s in enumerate(shards):
        if s.shard_offsets != (row, col0) or s.shard_sizes[1] != width or s.shard_sizes[0] <= 0:
            return [
                f"{kind} shard {i} must start at ({row}, {col0}) with > 0 rows and {width} "
                f"columns, got offsets {s.shard_offsets} sizes {s.shard_sizes}"
            ]
        row += s.shard_sizes[0]
    problems = [] if row == t.rows else [f"{kind} shards cover {row} rows, the table has {t.rows}"]
    ranks = [s.rank for s in shards]
    if len(set(ranks)) != len(ranks):
        problems.append(f"{kind} puts two row blocks on one rank: ranks {ranks}")
    return problems


def _one_host(ranks: Sequence[int], topo: Topology, what: str) -> list[str]:
    hosts = sorted({topo.host_of(r) for r in ranks})
    if len(hosts) <= 1:
        return []
    return [
        f"{what} ranks {list(ranks)} span hosts {hosts} "
        f"(local_world_size {topo.local_world_size}); all must be on one host"
    ]


def _rows(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    return _row_blocks(t, ps.shards, ps.sharding_type.value, 0, t.dim)


def _host_rows(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    return _rows(t, ps, topo) + _one_host(ps.ranks, topo, "table_row_wise")


def _grid(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    """Column pieces left to right; each piece's row blocks in row order, on one host."""
    pieces: list[list[ShardMetadata]] = []
    for s in ps.shards:
        if pieces and pieces[-1][0].shard_offsets[1] == s.shard_offsets[1]:
            pieces[-1].append(s)
        else:
            pieces.append([s])
    problems: list[str] = []
    col = 0
    for j, piece in enumerate(pieces):
        width = piece[0].shard_sizes[1]
        if piece[0].shard_offsets[1] != col or width <= 0:
            return [
                f"grid_shard column piece {j} must start at column {col} with > 0 columns, "
                f"got offsets {piece[0].shard_offsets} sizes {piece[0].shard_sizes}"
            ]
        kind = f"grid_shard column piece {j} (columns [{col}, {col + width}))"
        problems += _row_blocks(t, piece, kind, col, width)
        problems += _one_host([s.rank for s in piece], topo, kind)
        col += width
    if col != t.dim:
        problems.append(f"grid_shard column pieces cover {col} columns, the table has {t.dim}")
    return problems


def _every_rank(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    want = list(range(topo.world_size))
    problems = []
    if [s.rank for s in ps.shards] != want:
        problems.append(
            f"data_parallel needs one shard on every rank 0..{topo.world_size - 1} in order"
        )
    if any(s.shard_offsets != (0, 0) or s.shard_sizes != (t.rows, t.dim) for s in ps.shards):
        problems.append(
            f"data_parallel shards must all be the full table (0, 0) + ({t.rows}, {t.dim})"
        )
    if ps.compute_kernel is not EmbeddingComputeKernel.DENSE:
        problems.append(
            f"data_parallel uses compute kernel 'dense', got {ps.compute_kernel.value!r}"
        )
    return problems


VALIDATORS: dict[ShardingType, Callable[[TableSpec, ParameterSharding, Topology], list[str]]] = {
    ShardingType.TABLE_WISE: _one_full_shard,
    ShardingType.COLUMN_WISE: _columns,
    ShardingType.ROW_WISE: _rows,
    ShardingType.TABLE_ROW_WISE: _host_rows,
    ShardingType.GRID_SHARD: _grid,
    ShardingType.DATA_PARALLEL: _every_rank,
}


def sharding_problems(table: TableSpec, ps: ParameterSharding, topology: Topology) -> list[str]:
    """Every reason ``ps`` is not a valid sharding of ``table`` on ``topology`` (empty = valid)."""
    world = topology.world_size
    problems = []
    if not ps.shards:
        return ["it has no shards"]
    bad = sorted({s.rank for s in ps.shards if not 0 <= s.rank < world})
    if bad:
        problems.append(f"ranks {bad} are outside [0, {world})")
    if list(ps.ranks) != [s.rank for s in ps.shards]:
        problems.append(
            f"ranks {list(ps.ranks)} differ from the shards' ranks {[s.rank for s in ps.shards]}"
        )
    if (
        ps.sharding_type is not ShardingType.DATA_PARALLEL
        and ps.compute_kernel is not EmbeddingComputeKernel.FUSED
    ):
        problems.append(
            f"{ps.sharding_type.value} uses compute kernel 'fused', got {ps.compute_kernel.value!r}"
        )
    if table.num_buckets:
        problems += _dynamic(table, ps)
    return problems + VALIDATORS[ps.sharding_type](table, ps, topology)


def _dynamic(t: TableSpec, ps: ParameterSharding) -> list[str]:
    """A dynamic table: table_wise, or row_wise blocks that start and end on bucket boundaries."""
    if ps.sharding_type not in DYNAMIC_TYPES:
        valid = ", ".join(k.value for k in DYNAMIC_TYPES)
        return [f"sharding type '{ps.sharding_type.value}' cannot hold a dynamic table; valid: {valid}"]
    slots = t.slots_per_bucket
    return [
        f"dynamic table shard {i} rows [{s.shard_offsets[0]}, {s.shard_offsets[0] + s.shard_sizes[0]}) split a "
        f"bucket: blocks must start and end at multiples of {slots} (slots per bucket, {t.num_buckets} buckets)"
        for i, s in enumerate(ps.shards)
        if s.shard_offsets[0] % slots or s.shard_sizes[0] % slots
    ]
