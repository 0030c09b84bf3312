"""Dynamic tables in the planner's memory estimate and in the plan printout (capacity, id-map bytes)."""

from __future__ import annotations

import pytest

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper
from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingPlan, Topology
from lightning_shardrec.planner.costs.dynamic_plan import DynamicLayout
from lightning_shardrec.planner.machine.memory import size_text


def _tables(dynamic: DynamicConfig | None) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="u", embedding_dim=16, num_embeddings=4096, feature_names=["u"], dynamic=dynamic),
        EmbeddingBagConfig(name="s", embedding_dim=8, num_embeddings=100, feature_names=["s"]),
    ]


def _plan(dynamic: DynamicConfig | None, kind: str = "table_wise", world: int = 2) -> ShardingPlan:
    planner = EmbeddingShardingPlanner(
        Topology(world, compute_device="cpu"), constraints={"u": ParameterConstraints(sharding_types=[kind])}
    )
    return planner.plan(EmbeddingBagCollection(_tables(dynamic), device="meta"))


def _mapper_bytes(config: DynamicConfig, rows: int) -> int:
    """The buffers a real mapper allocates: slots, candidates, the window's id bitmap and 5 counters per
    bucket (step and the window's two counts excluded)."""
    mapper = DynamicIdMapper("u", config, rows)
    prefixes = ("slot_", "cand_", "window_ids")
    slots_and_cands = sum(b.nbytes for n, b in mapper.named_buffers() if n.startswith(prefixes))
    return slots_and_cands + mapper.num_buckets * 5 * 8


@pytest.mark.parametrize("config", [DynamicConfig(), DynamicConfig(min_count=3, candidates_per_bucket=5)])
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_id_map_bytes_in_the_memory_estimate(config, kind):
    dynamic, static = _plan(config, kind), _plan(None, kind)
    layout = dynamic.dynamic[""]["u"]
    assert layout.id_map_bytes == _mapper_bytes(config, 4096)
    assert (layout.num_buckets, layout.slots_per_bucket, layout.capacity) == (256, 16, 4096)
    assert layout.cands_per_bucket == (0 if config.min_count == 1 else 5)
    assert layout.weight_bytes == 4096 * 16 * 4 and layout.state_bytes == 4096 * 16 * 4  # adagrad: dim floats
    extra = sum(dynamic.stats.rank_storage) - sum(static.stats.rank_storage)
    assert abs(extra - layout.id_map_bytes) <= 2  # per-shard rounding up
    assert static.dynamic == {}


def test_plan_printout_and_json_round_trip():
    plan = _plan(DynamicConfig(min_count=2), "row_wise")
    text = plan.table()
    layout = plan.dynamic[""]["u"]
    assert "u (dynamic, 4096 slots) | row_wise" in text
    assert "dynamic tables (raw int64 ids -> slots):" in text
    assert (
        f"  <root>.u: capacity 4096 = 256 buckets x 16 slots, 16 candidates/bucket; memory "
        f"{size_text(layout.total_bytes)} = weights {size_text(layout.weight_bytes)} + optimizer state "
        f"{size_text(layout.state_bytes)} + id map {size_text(layout.id_map_bytes)}"
    ) in text
    assert "s (dynamic" not in text
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan and back.dynamic == plan.dynamic and back.table() == text
    static = _plan(None)
    assert "dynamic" not in static.to_json() and "dynamic" not in static.table()
    assert DynamicLayout(**layout.to_dict()) == layout


def test_plan_cli_sizes_dynamic_tables(tmp_path, capsys):
    from lightning_shardrec.plan import main

    (tmp_path / "t.yaml").write_text(
        "tables:\n"
        "  - {name: u, num_embeddings: 4096, embedding_dim: 16, dynamic: {min_count: 2}}\n"
        "  - {name: v, num_embeddings: 64, embedding_dim: 16, dynamic: true}\n"
        "  - {name: s, num_embeddings: 100, embedding_dim: 8}\n"
    )
    argv = ["--tables", str(tmp_path / "t.yaml"), "--world-size", "2", "--device", "cpu", "--batch-size", "8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    u, v = 4096 * 36 + 256 * (16 * 24 + 40), 64 * 36 + 4 * 40  # slots (and window bitmap), candidates, counters
    assert f"+ dynamic tables' id maps {size_text(u + v)}" in text
    assert "<root>.u: capacity 4096 = 256 buckets x 16 slots, 16 candidates/bucket" in text
    assert "<root>.v: capacity 64 = 4 buckets x 16 slots, no candidates (min_count 1)" in text
    bad = "tables:\n  - {name: u, num_embeddings: 64, embedding_dim: 4, dynamic: {ttl: 3}}\n"
    (tmp_path / "t.yaml").write_text(bad)
    assert main(argv) == 2
    assert "dynamic must be true or a mapping of DynamicConfig fields (eviction, ttl_steps," in capsys.readouterr().err
