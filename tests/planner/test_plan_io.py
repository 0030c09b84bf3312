"""ShardingPlan: JSON round trip, printed table, user-given (fixed) plans, the CLI."""

import re
from pathlib import Path

import pytest
from planner_helpers import check_plan

from lightning_shardrec import plan as plan_cli
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
from lightning_shardrec.planner.machine.topology import GiB


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
        match=r"rank 0 needs \d+ bytes \(0\.\d+ GiB\) for tables \['big'\]; 456340275 bytes \(0\.42 GiB\) "
        r"allowed\n  per rank: 0\.50 GiB capacity - 15% reserve \(0\.08 GiB\) = 0\.42 GiB for tables",
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


def _cli(tmp_path: Path, *extra: str, world: int = 64) -> list[str]:
    (tmp_path / "t.yaml").write_text(YAML)
    return ["--tables", str(tmp_path / "t.yaml"), "--world-size", str(world), "--batch-size", "1024", *extra]


def test_cli_states_every_assumption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_cli, "cuda_capacity", lambda index: None)  # as on a machine without a GPU
    out = tmp_path / "plan.json"
    assert main(_cli(tmp_path, "--json", str(out))) == 0
    text = capsys.readouterr().out
    assert "ranks: 64 = 8 host(s) x 8 GPU(s) per host (default for cuda: 8 GPUs per host)" in text
    assert "memory per rank: HBM 80.00 GiB (default for H100-class GPU; set --memory-gib for yours); " \
        "80.00 GiB capacity - 15% reserve (12.00 GiB) = 68.00 GiB for tables (--reserve)" in text
    assert "bandwidths: HBM 2000 GB/s, inside a host 450 GB/s, between hosts 50 GB/s per GPU" in text
    assert "batch: 1024 per rank, 65536 global" in text
    assert "optimizer: adagrad, state dim fp32 values per row (4 x dim bytes)" in text
    assert "note: ['item_id'] declare a data_type other than FP32" in text
    assert "covers embedding lookups, their fused optimizer update and their communication only" in text
    stats = ShardingPlan.from_json(out.read_text()).stats
    assert stats is not None
    assert f"{stats.max_cost * 1e3:.4f} ms/step (slowest rank) = {65536 / stats.max_cost:,.0f} samples/s" in text
    assert stats.verdict() in text and "fits, with the 15% reserve (12.00 GiB) kept free" in text


def test_cli_capacity_from_the_visible_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_cli, "cuda_capacity", lambda index: (40 * GiB, f"cuda:{index} FakeGPU"))
    assert main(_cli(tmp_path, world=4)) == 0
    text = capsys.readouterr().out
    assert "ranks: 4 = 1 host(s) x 4 GPU(s) per host (default for cuda: one host of up to 8 GPUs)" in text
    assert "HBM 40.00 GiB (total memory of the visible cuda:0 FakeGPU)" in text
    assert main(_cli(tmp_path, "--memory-gib", "20", "--device", "cpu", world=4)) == 0
    text = capsys.readouterr().out
    assert "ranks: 4 = 1 host(s) x 4 rank(s) per host (default for cpu: one host)" in text
    assert "DDR 20.00 GiB (--memory-gib)" in text


def test_cli_warns_when_the_reserve_is_lowered_into(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0.55 GiB, table-wise only, on one rank of 0.6 GiB: not with the default reserve, tightly without.
    (tmp_path / "big.yaml").write_text(
        "tables:\n  - {name: t, num_embeddings: 1150000, embedding_dim: 64, sharding_types: [table_wise]}\n"
    )
    argv = ["--tables", str(tmp_path / "big.yaml"), "--world-size", "1", "--batch-size", "8", "--memory-gib", "0.6"]
    assert main(argv) == 2
    assert "per rank: 0.60 GiB capacity - 15% reserve (0.09 GiB) = 0.51 GiB for tables" in capsys.readouterr().err
    assert main([*argv, "--reserve", "0"]) == 0
    captured = capsys.readouterr()
    assert "warning: verdict: max rank" in captured.err
    assert "WARNING, less than the default 15% (0.09 GiB) left for the dense model" in captured.err


def test_cli_host_and_reserve_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cli(tmp_path, world=12)) == 2
    assert (
        "--world-size 12 is not a multiple of the default 8 GPUs per host; give --local-world-size"
        in capsys.readouterr().err
    )
    assert main(_cli(tmp_path, "--reserve", "1.5")) == 2
    assert "reserve is the fraction of each rank's memory kept free" in capsys.readouterr().err


def test_cli_on_cpu_shares_the_host_memory_and_prints_the_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_shardrec.planner.machine.memory import RANK_ALLOWANCE

    assert main(_cli(tmp_path, "--device", "cpu", "--host-memory-gib", "8", world=4)) == 0
    text = capsys.readouterr().out
    assert "DDR 2.00 GiB (--host-memory-gib 8.00 GiB shared by 4 rank(s) per host)" in text
    peak = next(line for line in text.splitlines() if line.startswith("estimated peak per rank:"))
    assert f"+ {RANK_ALLOWANCE / GiB:.2f} GiB allowance (process and run, measured on CPU ranks)" in peak
    assert peak.endswith("of 2.00 GiB capacity: fits"), peak
    monkeypatch.setattr(plan_cli, "host_memory", lambda: 24 * GiB)  # this machine's, when not stated
    assert main(_cli(tmp_path, "--device", "cpu", world=2)) == 0
    assert "DDR 12.00 GiB (this machine's memory (/proc/meminfo, cgroup limit) 24.00 GiB shared by 2" in (
        capsys.readouterr().out
    )
    assert main(_cli(tmp_path, "--device", "cpu", "--host-memory-gib", "0.001", world=2)) == 2  # refused
    err = capsys.readouterr().err
    assert re.search(r"fullest rank \d: \d+ bytes \([\d.]+ GiB\) of tables, .* capacity 536870 bytes", err), err
    assert main(_cli(tmp_path, "--device", "cpu", "--host-memory-gib", "0", world=2)) == 2
    assert "--host-memory-gib must be > 0, got 0.0" in capsys.readouterr().err
