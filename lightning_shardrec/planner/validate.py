"""Check a ``ParameterSharding`` against its table and topology (user-given plans)."""

from __future__ import annotations

from collections.abc import Callable

from lightning_shardrec.planner.tables import TableSpec
from lightning_shardrec.planner.topology import Topology
from lightning_shardrec.planner.types import EmbeddingComputeKernel, ParameterSharding, ShardingType


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


def _rows(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    row = 0
    for i, s in enumerate(ps.shards):
        if s.shard_offsets != (row, 0) or s.shard_sizes[1] != t.dim or s.shard_sizes[0] <= 0:
            return [
                f"{ps.sharding_type.value} shard {i} must start at ({row}, 0) with > 0 rows and all "
                f"{t.dim} columns, got offsets {s.shard_offsets} sizes {s.shard_sizes}"
            ]
        row += s.shard_sizes[0]
    problems = (
        []
        if row == t.rows
        else [f"{ps.sharding_type.value} shards cover {row} rows, the table has {t.rows}"]
    )
    if len(set(ps.ranks)) != len(ps.ranks):
        problems.append(
            f"{ps.sharding_type.value} puts two row blocks on one rank: ranks {list(ps.ranks)}"
        )
    return problems


def _host_rows(t: TableSpec, ps: ParameterSharding, topo: Topology) -> list[str]:
    problems = _rows(t, ps, topo)
    hosts = sorted({topo.host_of(r) for r in ps.ranks})
    if len(hosts) > 1:
        problems.append(
            f"table_row_wise ranks {list(ps.ranks)} span hosts {hosts} "
            f"(local_world_size {topo.local_world_size}); all must be on one host"
        )
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
    return problems + VALIDATORS[ps.sharding_type](table, ps, topology)
