"""row_wise is TorchRec's: contiguous near-equal blocks on every rank; no plan has sliver
blocks; when step times tie, memory is balanced."""

from __future__ import annotations

import pytest
from planner_helpers import bag, check_plan

from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology
from lightning_shardrec.planner.machine.topology import GiB

ROW_WISE = ParameterConstraints(sharding_types=["row_wise"])


def _blocks(ps) -> list[tuple[int, int, int]]:
    """(rank, row offset, rows) of every shard, in shard order."""
    return [(s.rank, s.shard_offsets[0], s.shard_sizes[0]) for s in ps.shards]


def test_forced_row_wise_splits_20m_rows_10m_10m_on_two_ranks() -> None:
    tables = {"ebc": [bag("user_table", 20_000_000, 16)]}
    topo = Topology(2)
    plan = EmbeddingShardingPlanner(topo, constraints={"user_table": ROW_WISE}).plan(tables)
    check_plan(plan, tables, topo)
    ps = plan.plan["ebc"]["user_table"]
    assert ps.sharding_type is ShardingType.ROW_WISE
    assert _blocks(ps) == [(0, 0, 10_000_000), (1, 10_000_000, 10_000_000)]
    assert plan.stats.rank_storage[0] == plan.stats.rank_storage[1] > 0


@pytest.mark.parametrize(("rows", "world"), [(1_000_003, 64), (5, 8)])
def test_row_wise_blocks_cover_every_rank_in_order(rows: int, world: int) -> None:
    tables = {"": [bag("t", rows, 32)]}
    plan = EmbeddingShardingPlanner(Topology(world), constraints={"t": ROW_WISE}).plan(tables)
    blocks = _blocks(plan.plan[""]["t"])
    assert [r for r, _, _ in blocks] == list(range(min(rows, world)))
    assert [o for _, o, _ in blocks] == [sum(n for _, _, n in blocks[:i]) for i in range(len(blocks))]
    sizes = [n for _, _, n in blocks]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1


def test_row_wise_over_pinned_ranks_is_the_explicit_subset() -> None:
    cons = {"t": ParameterConstraints(sharding_types=["row_wise"], ranks=[2, 5, 6])}
    plan = EmbeddingShardingPlanner(Topology(8), constraints=cons).plan({"": [bag("t", 300_001, 32)]})
    assert _blocks(plan.plan[""]["t"]) == [(2, 0, 100_001), (5, 100_001, 100_000), (6, 200_001, 100_000)]


def test_64_rank_plan_has_no_sliver_blocks() -> None:
    # 24 tables of ~4M x 128: the planner row-blocks them (grid / table_row_wise); a block was
    # once 1 row next to blocks of millions. Every block is now at least half its piece's mean.
    tables = {"ebc": [bag(f"t{i}", 4_000_000 + 100_000 * i, 128) for i in range(24)]}
    topo = Topology(64, local_world_size=8, hbm_cap=80 * GiB)
    wide = {f"t{i}": ParameterConstraints(min_partition=32) for i in range(24)}  # 32-column pieces get row-blocked
    plan = EmbeddingShardingPlanner(topo, batch_size=4096, constraints=wide).plan(tables)
    check_plan(plan, tables, topo)
    row_blocked = 0
    for name, ps in plan.plan["ebc"].items():
        pieces: dict[int, list[int]] = {}
        for s in ps.shards:
            pieces.setdefault(s.shard_offsets[1], []).append(s.shard_sizes[0])
        for rows in pieces.values():
            row_blocked += len(rows) > 1
            assert min(rows) * len(rows) >= sum(rows) / 2, (name, ps.sharding_type.value, rows)
    assert row_blocked > 0  # the case is exercised


def test_equal_step_times_balance_memory() -> None:
    # Four tables of one cost (same width and pooling), two large and two small: each rank
    # gets one of each, not both large ones.
    tables = {"ebc": [bag(n, r, 16) for n, r in (("a", 4_000_000), ("b", 4_000_000), ("c", 10**6), ("d", 10**6))]}
    cons = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in "abcd"}
    plan = EmbeddingShardingPlanner(Topology(2), constraints=cons).plan(tables)
    assert plan.stats.rank_cost[0] == pytest.approx(plan.stats.rank_cost[1])
    assert plan.stats.rank_storage[0] == plan.stats.rank_storage[1]
    ranks = {n: ps.ranks for n, ps in plan.plan["ebc"].items()}
    assert ranks["a"] != ranks["b"] and ranks["c"] != ranks["d"]
