"""ShardingPlan: JSON round trip, printed table, user-given (fixed) plans, the CLI."""

from pathlib import Path

import pytest
from planner_helpers import check_plan

from lightning_shardrec.errors import PlannerError
from lightning_shardrec.plan import main
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    Topology,
)
from lightning_shardrec.planner.topology import GiB


def test_json_round_trip_equal(small_tables: dict) -> None:
    plan = EmbeddingShardingPlanner(Topology(8, local_world_size=4), batch_size=128).plan(
        small_tables
    )
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    assert again.stats == plan.stats
    assert ShardingPlan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_from_json_rejects_other_documents() -> None:
    with pytest.raises(ValueError, match='expected an object with a "plan" key'):
        ShardingPlan.from_json("[1, 2]")


def test_printed_table_has_full_names_values_and_stats(small_tables: dict) -> None:
    plan = EmbeddingShardingPlanner(Topology(4), batch_size=128).plan(small_tables)
    text = str(plan)
    assert "param" in text and "sharding type" in text and "kernel" in text and "ranks" in text
    for name in ("big", "mid", "small", "hist"):
        assert f"| {name}" in text
    values = {ps.sharding_type.value for t in plan.plan.values() for ps in t.values()}
    assert all(v in text for v in values)
    assert "imbalance (max/mean)" in text and "storage (bytes)" in text


def _tw(rank: int, rows: int, dim: int) -> ParameterSharding:
    return ParameterSharding(
        "table_wise", "fused", [rank], [ShardMetadata((0, 0), (rows, dim), rank)]
    )


def test_fixed_partial_plan_overrides(small_tables: dict) -> None:
    topo = Topology(4)
    planner = EmbeddingShardingPlanner(topo, batch_size=128)
    rw = ParameterSharding(
        ShardingType.ROW_WISE,
        "fused",
        [3, 1],
        [ShardMetadata((0, 0), (10, 32), 3), ShardMetadata((10, 0), (990, 32), 1)],
    )
    plan = planner.plan(small_tables, fixed={"big": _tw(2, 1_000_000, 128), "small": rw})
    assert plan.plan["ebc"]["big"] == _tw(2, 1_000_000, 128)
    assert plan.plan["ebc"]["small"] == rw
    check_plan(plan, small_tables, topo)
    whole = planner.plan(small_tables, fixed=plan)
    assert whole == plan


@pytest.mark.parametrize(
    ("sharding", "match"),
    [
        (_tw(7, 1_000_000, 128), r"table 'big' \(module 'ebc'\): ranks \[7\] are outside \[0, 4\)"),
        (_tw(0, 999, 128), r"table_wise shard must be offsets \(0, 0\) sizes \(1000000, 128\)"),
        (
            ParameterSharding(
                "column_wise",
                "fused",
                [0, 1],
                [
                    ShardMetadata((0, 0), (1_000_000, 64), 0),
                    ShardMetadata((0, 64), (1_000_000, 32), 1),
                ],
            ),
            "column_wise shards cover 96 columns, the table has 128",
        ),
        (
            ParameterSharding(
                "row_wise",
                "fused",
                [0, 0],
                [
                    ShardMetadata((0, 0), (500_000, 128), 0),
                    ShardMetadata((500_000, 0), (500_000, 128), 0),
                ],
            ),
            r"row_wise puts two row blocks on one rank: ranks \[0, 0\]",
        ),
        (
            ParameterSharding(
                "row_wise",
                "fused",
                [0, 1],
                [
                    ShardMetadata((0, 0), (600_000, 128), 0),
                    ShardMetadata((500_000, 0), (500_000, 128), 1),
                ],
            ),
            r"row_wise shard 1 must start at \(600000, 0\)",
        ),
        (
            ParameterSharding(
                "table_row_wise",
                "fused",
                [1, 2],
                [
                    ShardMetadata((0, 0), (500_000, 128), 1),
                    ShardMetadata((500_000, 0), (500_000, 128), 2),
                ],
            ),
            r"table_row_wise ranks \[1, 2\] span hosts \[0, 1\]",
        ),
        (
            ParameterSharding(
                "data_parallel",
                "fused",
                [0, 1, 2, 3],
                [ShardMetadata((0, 0), (1_000_000, 128), r) for r in range(4)],
            ),
            "data_parallel uses compute kernel 'dense', got 'fused'",
        ),
        (
            ParameterSharding(
                "table_wise", "dense", [0], [ShardMetadata((0, 0), (1_000_000, 128), 0)]
            ),
            "table_wise uses compute kernel 'fused', got 'dense'",
        ),
        (
            ParameterSharding(
                "table_wise", "fused", [1], [ShardMetadata((0, 0), (1_000_000, 128), 0)]
            ),
            r"ranks \[1\] differ from the shards' ranks \[0\]",
        ),
    ],
)
def test_invalid_fixed_plan_rejected(
    small_tables: dict, sharding: ParameterSharding, match: str
) -> None:
    planner = EmbeddingShardingPlanner(Topology(4, local_world_size=2), batch_size=128)
    with pytest.raises(PlannerError, match=match):
        planner.plan(small_tables, fixed={"big": sharding})


def test_fixed_plan_unknown_table(small_tables: dict) -> None:
    with pytest.raises(PlannerError, match="table 'nope' is not in the model; available: ebc.big"):
        EmbeddingShardingPlanner(Topology(4)).plan(small_tables, fixed={"nope": _tw(0, 1, 1)})
    bad = ShardingPlan({"other": {"big": _tw(0, 1_000_000, 128)}})
    with pytest.raises(PlannerError, match=r"table 'big' \(module 'other'\) is not in the model"):
        EmbeddingShardingPlanner(Topology(4)).plan(small_tables, fixed=bad)


def test_fixed_plan_over_memory(small_tables: dict) -> None:
    planner = EmbeddingShardingPlanner(Topology(4, hbm_cap=GiB // 2), batch_size=8)
    with pytest.raises(
        PlannerError,
        match=r"rank 0 needs \d+ bytes \(0\.\d+ GiB\) for tables \['big'\]; capacity 536870912 bytes",
    ):
        planner.plan(small_tables, fixed={"big": _tw(0, 1_000_000, 128)})


YAML = """
modules:
  sparse.ebc:
    - {name: user_id, num_embeddings: 400000, embedding_dim: 128, pooling_factors: [3.0]}
    - {name: item_id, num_embeddings: 30000, embedding_dim: 64, data_type: fp16}
    - {name: tiny, num_embeddings: 10, embedding_dim: 16}
  sparse.ec:
    - {name: history, num_embeddings: 100000, embedding_dim: 32, kind: sequence, sharding_types: [row_wise]}
"""


def test_cli_plans_yaml_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.yaml").write_text(YAML)
    out = tmp_path / "plan.json"
    argv = [
        "--tables",
        str(tmp_path / "t.yaml"),
        "--world-size",
        "16",
        "--local-world-size",
        "8",
        "--device",
        "cuda",
        "--batch-size",
        "1024",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "user_id" in text and "history" in text and "row_wise" in text
    plan = ShardingPlan.from_json(out.read_text())
    assert plan.plan["sparse.ec"]["history"].sharding_type is ShardingType.ROW_WISE
    assert main([*argv[:-2], "--fixed", str(out)]) == 0


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.yaml").write_text(
        "modules:\n  m:\n    - {name: a, num_embeddings: 10, embedding_dim: 4, colour: red}\n"
    )
    assert (
        main(["--tables", str(tmp_path / "t.yaml"), "--world-size", "2", "--batch-size", "8"]) == 2
    )
    assert "unknown table field(s) ['colour']; available: name" in capsys.readouterr().err
    (tmp_path / "t.yaml").write_text(
        "modules:\n  m:\n    - {name: a, num_embeddings: 10, embedding_dim: 4, kind: ragged}\n"
    )
    assert (
        main(["--tables", str(tmp_path / "t.yaml"), "--world-size", "2", "--batch-size", "8"]) == 2
    )
    assert "unknown table kind in" in capsys.readouterr().err
    (tmp_path / "t.yaml").write_text("- 1\n")
    assert (
        main(["--tables", str(tmp_path / "t.yaml"), "--world-size", "2", "--batch-size", "8"]) == 2
    )
    assert "expected a top-level 'modules' mapping or 'tables' list" in capsys.readouterr().err
