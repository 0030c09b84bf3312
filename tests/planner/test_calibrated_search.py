"""With measured rates the planner picks the plan of the least estimated step, per-plan costs included.

A cut table levels the ranks' loads but adds its group's collective calls, a group and pieces
(``rates.step_estimate``), which no rank's load shows. Without rates the search is unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_helpers import RATES as BASE

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Rates,
    ShardingPlan,
    Topology,
    step_estimate,
)

#: calls, groups and pieces dear enough to outweigh levelling the ranks; rows at a miss each
RATES = replace(BASE, memory_bw=2e9, collective_seconds=1e-3, host_call_seconds=1e-3, row_seconds=2e-7)
#: the same machine if calls, groups and pieces cost nothing
FREE_CALLS = replace(
    RATES,
    collective_seconds=0.0,
    host_call_seconds=0.0,
    reduce_scatter_seconds=0.0,
    group_seconds=0.0,
    table_seconds=0.0,
)


def ebc() -> EmbeddingBagCollection:
    """One large table and five small ones: levelling the ranks means cutting the large one."""
    shapes = [(400_000, 64), (20_000, 32), (5_000, 32), (2_000, 16), (1_000, 16), (200, 16)]
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
            for i, (n, d) in enumerate(shapes)
        ],
        device="meta",
    )


def planner(rates: Rates | None, kinds: list[str] | None = None) -> EmbeddingShardingPlanner:
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=rates)
    # the large table is also the busiest (12 ids a sample): one rank cannot hold it and keep up
    cons = {
        f"t{i}": ParameterConstraints(sharding_types=kinds, pooling_factors=[12.0 if i == 0 else 4.0]) for i in range(6)
    }
    return EmbeddingShardingPlanner(topo, batch_size=256, constraints=cons)


def kinds(plan: ShardingPlan) -> dict[str, str]:
    return {name: ps.sharding_type.value for name, ps in plan.plan[""].items()}


def priced(plan: ShardingPlan, rates: Rates) -> float:
    """``plan``'s layout, estimated at ``rates``."""
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=rates)
    return step_estimate(planner(rates).plan(ebc(), fixed=plan), topo)


def test_per_plan_costs_keep_a_table_whole_that_levelling_would_cut() -> None:
    """row_wise is a group of its own (2 all-to-alls, a reduce-scatter, an all-gather): worth it only when
    calls are free."""
    both = ["table_wise", "row_wise"]
    levelled = planner(FREE_CALLS, both).plan(ebc())
    assert kinds(levelled)["t0"] == "row_wise"
    chosen = planner(RATES, both).plan(ebc())
    assert set(kinds(chosen).values()) == {"table_wise"}
    assert priced(chosen, RATES) < priced(levelled, RATES)
    assert priced(levelled, FREE_CALLS) < priced(chosen, FREE_CALLS)


@pytest.mark.parametrize("rates", [RATES, FREE_CALLS, replace(RATES, group_seconds=0.0, collective_seconds=2e-4)])
def test_the_chosen_plan_is_estimated_no_slower_than_whole_tables_or_no_replicas(rates: Rates) -> None:
    chosen = priced(planner(rates).plan(ebc()), rates)
    whole = planner(rates, ["table_wise"]).plan(ebc())  # no cut, no replicated table
    assert chosen <= priced(whole, rates) * (1 + 1e-9)


def test_without_rates_the_search_levels_the_slowest_rank_as_before(monkeypatch) -> None:
    import lightning_shardrec.planner.search.planner as planner_module

    def no_estimate(*args, **kwargs) -> float:  # type: ignore[no-untyped-def]
        raise AssertionError("a plan without rates was scored by step_estimate")

    monkeypatch.setattr(planner_module, "step_estimate", no_estimate)
    plain = planner(None).plan(ebc())
    assert plain.stats.phase_cost == {}
    assert kinds(plain)["t0"] != "table_wise"  # levelled: the large table is cut
    with pytest.raises(AssertionError, match="scored by step_estimate"):
        planner(RATES).plan(ebc())


def test_partition_keeps_the_plan_its_score_prefers() -> None:
    """Given a score, the plan partition returns scores no worse than the load-only plan's."""
    from lightning_shardrec.planner.costs.perf import Workload
    from lightning_shardrec.planner.plans.tables import find_tables, table_specs
    from lightning_shardrec.planner.search.enumerate import table_options
    from lightning_shardrec.planner.search.partition import makespan, partition

    work = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2), batch_size=256)
    opts = [table_options(s, work) for s in table_specs(find_tables(ebc()), {}, 4)]
    free = [2.0**40] * 4

    def pieces(placed, ranks) -> float:  # type: ignore[no-untyped-def]
        return max(ranks.load) + 1.0 * sum(len(p.pieces) for p in placed)  # a piece costs a second

    base = partition(opts, work, [0.0] * 4, free, 0.0)
    scored = partition(opts, work, [0.0] * 4, free, 0.0, score=pieces)
    assert sum(len(p.pieces) for p in base[0]) > len(opts)  # levelling cuts a table
    assert pieces(scored[0], scored[2]) <= pieces(base[0], base[2])
    assert all(len(p.pieces) == 1 for p in scored[0])  # whole tables win
    assert partition(opts, work, [0.0] * 4, free, 0.0, score=makespan)[0] == base[0]
