"""Planner: feasible plans under memory caps, constraints obeyed, named errors, determinism."""

import pytest
import torch
from planner_helpers import bag, check_plan, seq
from torch import nn

from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingType,
    Topology,
)
from lightning_shardrec.planner.machine.topology import GiB

ALL_BUT_DP = [s for s in ShardingType if s is not ShardingType.DATA_PARALLEL]


class _FakeEBC(nn.Module):
    def __init__(self, configs: list) -> None:
        super().__init__()
        self._configs = configs
        self.inner = nn.Linear(1, 1)

    def embedding_bag_configs(self) -> list:
        return self._configs


class _FakeEC(nn.Module):
    def __init__(self, configs: list) -> None:
        super().__init__()
        self._configs = configs

    def embedding_configs(self) -> list:
        return self._configs


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = nn.ModuleDict(
            {
                "ebc": _FakeEBC([bag("a", 10_000), bag("b", 500_000, 128)]),
                "ec": _FakeEC([seq("s", 3_000)]),
            }
        )
        self.dense = nn.Linear(4, 4)


@pytest.mark.parametrize("world", [1, 2, 8, 16])
def test_plan_is_valid_and_fits(small_tables: dict, world: int) -> None:
    topo = Topology(world, local_world_size=min(world, 4))
    plan = EmbeddingShardingPlanner(topo, batch_size=256).plan(small_tables)
    check_plan(plan, small_tables, topo)


def test_module_collections_found_by_duck_typing() -> None:
    plan = EmbeddingShardingPlanner(Topology(4), batch_size=64).plan(_Model())
    assert set(plan.plan) == {"sparse.ebc", "sparse.ec"}
    assert set(plan.get_plan_for_module("sparse.ebc")) == {"a", "b"}
    assert plan.get_plan_for_module("dense") is None


def test_root_module_is_path_empty() -> None:
    plan = EmbeddingShardingPlanner(Topology(2), batch_size=8).plan(_FakeEBC([bag("a", 100)]))
    assert list(plan.plan) == [""]


def test_module_without_collections_is_an_error() -> None:
    with pytest.raises(PlannerError, match="Linear has no embedding collection"):
        EmbeddingShardingPlanner(Topology(2)).plan(nn.Linear(2, 2))


def test_memory_caps_force_splitting() -> None:
    # 4M x 128 fp32 + adagrad = 4 GiB; each rank holds 1.5 GiB, so it must be cut.
    tables = {"ebc": [bag("huge", 4 * 2**20, 128)]}
    topo = Topology(4, hbm_cap=int(1.5 * GiB))
    plan = EmbeddingShardingPlanner(topo, batch_size=16).plan(tables)
    check_plan(plan, tables, topo)
    ps = plan.plan["ebc"]["huge"]
    assert ps.sharding_type is not ShardingType.TABLE_WISE and len(ps.shards) >= 3


def test_infeasible_names_every_table_and_capacity() -> None:
    tables = {"ebc": [bag("huge", 4 * 2**20, 128), bag("huge2", 4 * 2**20, 128), bag("ok", 10)]}
    topo = Topology(2, hbm_cap=GiB)
    with pytest.raises(
        PlannerError,
        match=r"(?s)table 'huge' \(module 'ebc'\) needs \d+ bytes \(4\.\d+ GiB"
        r".*largest free capacity \d+ bytes.*\n  table 'huge2'",
    ):
        EmbeddingShardingPlanner(topo, batch_size=8).plan(tables)


def test_table_wise_only_too_big_for_one_rank() -> None:
    tables = {"": [bag("wide", 2 * 2**20, 128)]}
    cons = {"wide": ParameterConstraints(sharding_types=["table_wise"])}
    with pytest.raises(
        PlannerError,
        match=r"table 'wide' needs \d+ bytes .* with sharding types \['table_wise'\]; "
        r"largest free capacity 912680550 bytes \(0\.85 GiB, rank 0\).*"
        r"\n  per rank: 1\.00 GiB capacity - 15% reserve \(0\.15 GiB\) = 0\.85 GiB for tables",
    ):
        EmbeddingShardingPlanner(Topology(8, hbm_cap=GiB), batch_size=8, constraints=cons).plan(
            tables
        )


def test_sharding_type_constraint_obeyed(small_tables: dict) -> None:
    cons = {
        "big": ParameterConstraints(sharding_types=["row_wise"]),
        "mid": ParameterConstraints(sharding_types=["column_wise"], min_partition=16),
    }
    topo = Topology(8)
    plan = EmbeddingShardingPlanner(topo, batch_size=4096, constraints=cons).plan(small_tables)
    check_plan(plan, small_tables, topo)
    assert plan.plan["ebc"]["big"].sharding_type is ShardingType.ROW_WISE
    mid = plan.plan["ebc"]["mid"]
    assert mid.sharding_type is ShardingType.COLUMN_WISE
    assert all(s.shard_sizes[1] >= 16 for s in mid.shards)


def test_min_partition_limits_column_shards() -> None:
    tables = {"": [bag(f"t{i}", 1000, 128) for i in range(2)]}
    cons = {
        f"t{i}": ParameterConstraints(sharding_types=["column_wise"], min_partition=64)
        for i in range(2)
    }
    plan = EmbeddingShardingPlanner(Topology(16), batch_size=4096, constraints=cons).plan(tables)
    for ps in plan.plan[""].values():
        assert all(s.shard_sizes[1] >= 64 for s in ps.shards) and len(ps.shards) <= 2


def test_ranks_pinning_obeyed(small_tables: dict) -> None:
    cons = {
        "big": ParameterConstraints(ranks=[5, 6], sharding_types=ALL_BUT_DP),
        "small": ParameterConstraints(ranks=[7], sharding_types=["table_wise"]),
    }
    plan = EmbeddingShardingPlanner(Topology(8), batch_size=2048, constraints=cons).plan(
        small_tables
    )
    assert set(plan.plan["ebc"]["big"].ranks) <= {5, 6}
    assert plan.plan["ebc"]["small"].ranks == (7,)


def test_pinned_ranks_outside_world() -> None:
    cons = {"big": ParameterConstraints(ranks=[9])}
    with pytest.raises(
        PlannerError, match=r"table 'big' \(module 'ebc'\): pinned ranks \[9\] are outside \[0, 8\)"
    ):
        EmbeddingShardingPlanner(Topology(8), constraints=cons).plan({"ebc": [bag("big", 10)]})


def test_constraints_for_unknown_table_list_available() -> None:
    with pytest.raises(
        PlannerError, match=r"constraints name unknown tables \['nope'\]; available: big"
    ):
        EmbeddingShardingPlanner(Topology(2), constraints={"nope": ParameterConstraints()}).plan(
            {"ebc": [bag("big", 10)]}
        )


def test_pooling_factors_per_feature_must_match() -> None:
    cons = {"big": ParameterConstraints(pooling_factors=[1.0, 2.0])}
    with pytest.raises(
        PlannerError, match=r"pooling_factors has 2 values but the table has 1 features"
    ):
        EmbeddingShardingPlanner(Topology(2), constraints=cons).plan({"ebc": [bag("big", 10)]})


def test_no_usable_sharding_type() -> None:
    cons = {
        "big": ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["fused"])
    }
    with pytest.raises(
        PlannerError, match=r"table 'big' \(module 'ebc'\): no sharding type fits its constraints"
    ):
        EmbeddingShardingPlanner(Topology(2), constraints=cons).plan({"ebc": [bag("big", 10)]})


def test_duplicate_table_in_module() -> None:
    with pytest.raises(
        PlannerError, match=r"table 'a' \(module 'ebc'\) appears twice in the same module"
    ):
        EmbeddingShardingPlanner(Topology(2)).plan({"ebc": [bag("a", 10), bag("a", 20)]})


def test_bad_input_type() -> None:
    with pytest.raises(TypeError, match="plan\\(\\) takes an nn.Module or a dict"):
        EmbeddingShardingPlanner(Topology(2)).plan([bag("a", 10)])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="module 'ebc': tables must be EmbeddingBagConfig / EmbeddingConfig"
    ):
        EmbeddingShardingPlanner(Topology(2)).plan({"ebc": ["a"]})  # type: ignore[list-item]


def test_bad_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        EmbeddingShardingPlanner(Topology(2), batch_size=0)


def test_data_parallel_for_tiny_tables_dense_kernel() -> None:
    tables = {"ebc": [bag("tiny", 4, 16), bag("big", 1_000_000, 64)]}
    plan = EmbeddingShardingPlanner(Topology(4), batch_size=1024).plan(tables)
    tiny = plan.plan["ebc"]["tiny"]
    assert tiny.sharding_type is ShardingType.DATA_PARALLEL
    assert tiny.compute_kernel is EmbeddingComputeKernel.DENSE and tiny.ranks == (0, 1, 2, 3)


def test_deterministic(small_tables: dict) -> None:
    planner = EmbeddingShardingPlanner(Topology(16, local_world_size=8), batch_size=512)
    first = planner.plan(small_tables)
    second = EmbeddingShardingPlanner(Topology(16, local_world_size=8), batch_size=512).plan(
        small_tables
    )
    assert first == second and first.to_json() == second.to_json()


def test_balances_many_equal_tables_near_lower_bound() -> None:
    tables = {"": [bag(f"t{i}", 100_000, 128) for i in range(10)]}
    cons = {f"t{i}": ParameterConstraints(sharding_types=ALL_BUT_DP) for i in range(10)}
    plan = EmbeddingShardingPlanner(Topology(8), batch_size=1024, constraints=cons).plan(tables)
    assert plan.stats is not None and plan.stats.vs_lower_bound < 1.1
    assert any(ps.sharding_type is not ShardingType.TABLE_WISE for ps in plan.plan[""].values())


def test_collective_plan_single_process_gloo(small_tables: dict) -> None:
    import torch.distributed as dist

    from lightning_shardrec.planner import collective_plan

    planner = EmbeddingShardingPlanner(Topology(2), batch_size=8)
    assert planner.collective_plan(small_tables) == planner.plan(small_tables)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert Topology.from_process_group().compute_device.value == "cpu"
        assert collective_plan(planner, small_tables) == planner.plan(small_tables)
        assert planner.collective_plan(small_tables, [], dist.group.WORLD) == planner.plan(small_tables)
        default = EmbeddingShardingPlanner()  # TorchRec's default topology: the live group
        assert (default.topology.world_size, default.topology.compute_device.value) == (1, "cpu")
    finally:
        dist.destroy_process_group()
    assert torch.distributed.is_initialized() is False


def test_equal_cost_tables_spread_storage_issue_10() -> None:
    """4 x 200k + 4 x 20k rows cost the same per step; ties go to the rank with more free memory."""
    names = [f"big_{i}" for i in range(4)] + [f"small_{i}" for i in range(4)]
    tables = {"ebc": [bag(n, 200_000 if n.startswith("big") else 20_000) for n in names]}
    cons = {n: ParameterConstraints(pooling_factors=[8.0]) for n in names}
    planner = EmbeddingShardingPlanner(
        Topology(2, compute_device="cpu"),
        batch_size=1024,
        constraints=cons,
        optimizer="rowwise_adagrad",
    )
    plan = planner.plan(tables)
    check_plan(plan, tables, planner.topology)
    assert plan.stats is not None
    storage = plan.stats.rank_storage
    assert max(storage) <= 1.2 * min(storage), storage
    assert plan.stats.vs_lower_bound < 1.01
    assert plan == planner.plan(tables)


def plan_infeasible_on_every_rank(rank: int, world: int) -> str:
    tables = {"ebc": [bag("huge", 4 * 2**20, 128)]}
    try:
        EmbeddingShardingPlanner(Topology(world, hbm_cap=GiB), batch_size=8).collective_plan(tables)
    except PlannerError as e:
        return str(e)
    return "planned"


def test_collective_plan_failure_raises_on_every_rank() -> None:
    """Rank 0 plans; its PlannerError reaches rank 1 too, which would otherwise wait in the broadcast."""
    from lightning_shardrec.testing import run_ranks

    errors = run_ranks(plan_infeasible_on_every_rank, 2)
    assert errors[0] == errors[1] and "table 'huge' (module 'ebc') needs" in errors[0]
