"""Planner test helpers: table builders, a full validity check of a plan, measured rates."""

from __future__ import annotations

from lightning_shardrec.configs import EmbeddingBagConfig, EmbeddingConfig
from lightning_shardrec.planner import Rates, ShardingPlan, Topology, sharding_problems
from lightning_shardrec.planner.machine.memory import MemoryBudget
from lightning_shardrec.planner.plans.tables import table_specs


def bag(name: str, rows: int, dim: int = 64) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[f"f_{name}"])


def seq(name: str, rows: int, dim: int = 32) -> EmbeddingConfig:
    return EmbeddingConfig(num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[f"f_{name}"])


def check_plan(plan: ShardingPlan, tables: dict, topology: Topology) -> None:
    """Every table planned, every sharding valid, no rank over its memory."""
    specs = table_specs(tables, {}, topology.world_size)
    assert {(s.path, s.name) for s in specs} == {(p, n) for p, t in plan.plan.items() for n in t}
    for spec in specs:
        problems = sharding_problems(spec, plan.plan[spec.path][spec.name], topology)
        assert not problems, (spec.name, problems)
    assert plan.stats is not None
    assert plan.stats.storage_cap == topology.memory_cap
    assert max(plan.stats.rank_storage) <= MemoryBudget(topology.memory_cap, plan.stats.reserve).tables


#: measured rates for calibrated cost-model tests (``Topology(rates=...)``)
RATES = Rates(
    memory_bw=5e9,
    lookup_seconds=1e-4,
    intra_host_bw=6e8,
    inter_host_bw=2.5e8,
    reduce_scatter_bw=2e8,
    allreduce_bw=4e8,
    dense_bw=3e8,
    step_seconds=5e-3,
    collective_seconds=5e-4,
    host_call_seconds=7e-4,
    reduce_scatter_seconds=2e-3,
    group_seconds=3e-3,
    table_seconds=2e-4,
    source="test",
)
