"""Planning dynamic tables: table_wise, or row_wise blocks of whole buckets; other types refused by name."""

from __future__ import annotations

import pytest

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from lightning_shardrec.configs import EmbeddingConfig
from lightning_shardrec.distributed.sharding import TableSharding
from lightning_shardrec.distributed.sharding.dynamic_blocks import check_dynamic_plan
from lightning_shardrec.errors import PlannerError, ShardingError
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
    Topology,
)


def dyn(name: str = "d", rows: int = 60, buckets: int = 5, dim: int = 8, seq: bool = False):
    kind = EmbeddingConfig if seq else EmbeddingBagConfig
    return kind(
        name=name,
        embedding_dim=dim,
        num_embeddings=rows,
        feature_names=[f"{name}_f"],
        dynamic=DynamicConfig(num_buckets=buckets),
    )


def planner(world: int, **constraints: ParameterConstraints) -> EmbeddingShardingPlanner:
    return EmbeddingShardingPlanner(Topology(world_size=world, compute_device="cpu"), constraints=constraints)


def blocks(ps: ParameterSharding) -> list[tuple[int, int, int]]:
    return [(s.shard_offsets[0], s.shard_sizes[0], s.rank) for s in ps.shards]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq", [False, True])
def test_row_wise_blocks_are_near_equal_bucket_ranges(world: int, seq: bool) -> None:
    # 5 buckets of 12 slots: blocks of 5 / (3, 2) / (2, 2, 1) / (2, 1, 1, 1) buckets, rank order
    cls = EmbeddingCollection if seq else EmbeddingBagCollection
    module = cls([dyn(seq=seq), dyn("small", rows=8, buckets=2, seq=seq)], device="meta")
    row_wise = ParameterConstraints(sharding_types=["row_wise"])
    plan = planner(world, d=row_wise, small=row_wise).plan(module).plan[""]
    counts = [5 // world + (i < 5 % world) for i in range(min(world, 5))]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    assert blocks(plan["d"]) == [(12 * s, 12 * n, r) for r, (s, n) in enumerate(zip(starts, counts, strict=True))]
    # fewer buckets than ranks: one bucket on each of the first ranks
    assert blocks(plan["small"]) == ([(0, 8, 0)] if world == 1 else [(0, 4, 0), (4, 4, 1)])


def test_a_dynamic_table_is_planned_as_table_or_row_wise_and_costs_its_capacity() -> None:
    static = EmbeddingBagConfig(name="s", embedding_dim=8, num_embeddings=60, feature_names=["s_f"])
    plan = planner(2).plan(EmbeddingBagCollection([dyn()], device="meta"))
    assert plan.plan[""]["d"].sharding_type in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)
    tw = ParameterConstraints(sharding_types=["table_wise"])
    plan = planner(2, d=tw).plan(EmbeddingBagCollection([dyn()], device="meta"))
    twin = planner(2, s=tw).plan(EmbeddingBagCollection([static], device="meta"))
    id_map = plan.dynamic[""]["d"].id_map_bytes  # 4 int64 + 4 bitmap bytes per slot, 5 counters per bucket
    assert id_map == 60 * (4 * 8 + 4) + 5 * 5 * 8
    assert sorted(plan.stats.rank_storage) == [0, max(twin.stats.rank_storage) + id_map]  # capacity x dim + id map


@pytest.mark.parametrize("kind", ["column_wise", "table_row_wise", "grid_shard", "data_parallel"])
def test_constraints_asking_for_a_type_that_cannot_hold_it_are_refused(kind: str) -> None:
    c = ParameterConstraints(sharding_types=["table_wise", kind])
    with pytest.raises(
        PlannerError,
        match=rf"dynamic table 'd': sharding_types \['{kind}'\] cannot hold a dynamic table; "
        r"valid: table_wise, row_wise",
    ):
        planner(2, d=c).plan(EmbeddingBagCollection([dyn()], device="meta"))


def test_row_wise_over_more_pinned_ranks_than_buckets_is_refused() -> None:
    c = ParameterConstraints(sharding_types=["row_wise"], ranks=[0, 1, 2])
    with pytest.raises(
        PlannerError,
        match=r"dynamic table 'd': row_wise over ranks \[0, 1, 2\] needs a block of whole buckets on each of 3 ranks, "
        r"but the table has 2 buckets",
    ):
        planner(3, d=c).plan(EmbeddingBagCollection([dyn(buckets=2)], device="meta"))
    # with table_wise allowed too, it is planned table-wise on a pinned rank
    c = ParameterConstraints(ranks=[0, 1, 2])
    plan = planner(3, d=c).plan(EmbeddingBagCollection([dyn(buckets=2)], device="meta"))
    assert plan.plan[""]["d"].sharding_type is ShardingType.TABLE_WISE


def _row_wise(cuts: list[int], dim: int = 8) -> ParameterSharding:
    shards = [ShardMetadata((a, 0), (b - a, dim), r) for r, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))]
    return ParameterSharding(ShardingType.ROW_WISE, EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards)


def test_a_given_plan_that_splits_a_bucket_or_uses_another_type_is_refused() -> None:
    module = EmbeddingBagCollection([dyn()], device="meta")
    with pytest.raises(
        PlannerError,
        match=r"table 'd': dynamic table shard 0 rows \[0, 30\) split a bucket: "
        r"blocks must start and end at multiples of 12 \(slots per bucket, 5 buckets\)",
    ):
        planner(2).plan(module, fixed={"d": _row_wise([0, 30, 60])})
    cw = ParameterSharding(
        ShardingType.COLUMN_WISE,
        EmbeddingComputeKernel.FUSED,
        [0, 1],
        [ShardMetadata((0, 0), (60, 4), 0), ShardMetadata((0, 4), (60, 4), 1)],
    )
    with pytest.raises(
        PlannerError,
        match=r"table 'd': sharding type 'column_wise' cannot hold a dynamic table; "
        r"valid: table_wise, row_wise",
    ):
        planner(2).plan(module, fixed={"d": cw})
    assert blocks(planner(2).plan(module, fixed={"d": _row_wise([0, 36, 60])}).plan[""]["d"]) == [
        (0, 36, 0),
        (36, 24, 1),
    ]


def test_the_sharded_module_checks_a_complete_plan_too() -> None:
    """DistributedModelParallel skips the planner for a complete plan: the sharding checks it."""
    table = dyn()
    with pytest.raises(
        ShardingError,
        match=r"dynamic table 'd': shard 0 holds rows \[0, 30\), which splits a bucket; "
        r"blocks must start and end at multiples of 12 \(slots per bucket, 5 buckets\)",
    ):
        check_dynamic_plan(TableSharding(table, _row_wise([0, 30, 60]), None))
    grid = ParameterSharding(
        ShardingType.GRID_SHARD, EmbeddingComputeKernel.FUSED, [0], [ShardMetadata((0, 0), (60, 8), 0)]
    )
    with pytest.raises(
        ShardingError,
        match=r"dynamic table 'd': sharding type 'grid_shard' cannot hold it; "
        r"valid: table_wise, row_wise",
    ):
        check_dynamic_plan(TableSharding(table, grid, None))
    cols = ParameterSharding(
        ShardingType.ROW_WISE, EmbeddingComputeKernel.FUSED, [0], [ShardMetadata((0, 0), (60, 4), 0)]
    )
    with pytest.raises(
        ShardingError,
        match=r"dynamic table 'd': shard 0 holds columns \[0, 4\); a dynamic table's "
        r"shards hold all 8 columns",
    ):
        check_dynamic_plan(TableSharding(table, cols, None))


def test_the_mechanism_of_a_dynamic_table_refuses_a_type_that_cannot_hold_it() -> None:
    from lightning_shardrec.distributed.sharding import DynamicRowSharding, DynamicTableSharding, mechanism

    table = dyn()
    shard = [ShardMetadata((0, 0), (60, 8), 0)]
    kinds = {t: mechanism(table, ParameterSharding(t, EmbeddingComputeKernel.FUSED, [0], shard))
             for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)}  # fmt: skip
    assert kinds == {ShardingType.TABLE_WISE: DynamicTableSharding, ShardingType.ROW_WISE: DynamicRowSharding}
    columns = ParameterSharding(ShardingType.COLUMN_WISE, EmbeddingComputeKernel.FUSED, [0], shard)
    with pytest.raises(ShardingError, match=r"dynamic table 'd': sharding type 'column_wise' cannot hold it; "
                       r"valid: table_wise, row_wise"):  # fmt: skip
        mechanism(table, columns)
