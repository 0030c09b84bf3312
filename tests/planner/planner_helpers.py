"""Planner test helpers: table builders and a full validity check of a plan."""

from __future__ import annotations

from lightning_shardrec.configs import EmbeddingBagConfig, EmbeddingConfig
from lightning_shardrec.planner import ShardingPlan, Topology, sharding_problems
from lightning_shardrec.planner.memory import MemoryBudget
from lightning_shardrec.planner.tables import table_specs


def bag(name: str, rows: int, dim: int = 64) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[f"f_{name}"]
    )


def seq(name: str, rows: int, dim: int = 32) -> EmbeddingConfig:
    return EmbeddingConfig(
        num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[f"f_{name}"]
    )


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
