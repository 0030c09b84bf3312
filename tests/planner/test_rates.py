"""Calibrated rates (``Topology(rates=...)``): opt-in, loaded from the file the calibration writes."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
from planner_helpers import RATES

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Rates,
    ShardingPlan,
    ShardingType,
    Topology,
    Workload,
    shard_perf,
    step_estimate,
)
from lightning_shardrec.planner.machine.rates import (
    BASE_CALLS,
    DDP_BUCKET_BYTES,
    Calls,
    calls_seconds,
    collectives,
    critical_path,
    groups,
    phase_seconds,
    pieces,
    step_calls,
)
from lightning_shardrec.planner.plans.tables import find_tables, table_specs


def ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
            for i, (n, d) in enumerate([(10_000, 64), (2_000, 32), (100, 16)])
        ],
        device="meta",
    )


def plan(kinds: dict[str, str], rates: Rates | None = RATES, local: int = 2):
    topo = Topology(4, compute_device="cpu", local_world_size=local, rates=rates)
    cons = {
        t: ParameterConstraints(
            sharding_types=[k], compute_kernels=["dense"] if k == "data_parallel" else None, pooling_factors=[4.0]
        )
        for t, k in kinds.items()
    }
    return EmbeddingShardingPlanner(topo, batch_size=64, constraints=cons).plan(ebc())


def test_rates_file_round_trip_and_topology_takes_its_bandwidths(tmp_path) -> None:
    path = tmp_path / "rates.json"
    RATES.save(path)
    assert Rates.load(path) == RATES
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=str(path))
    assert topo.rates == RATES
    assert (topo.ddr_bw, topo.intra_host_bw, topo.inter_host_bw) == (5e9, 6e8, 2.5e8)
    # a bandwidth given explicitly wins over the file's
    assert Topology(4, compute_device="cpu", inter_host_bw=1e9, rates=RATES).inter_host_bw == 1e9
    # on cuda the measured memory rate is the HBM's
    assert Topology(2, compute_device="cuda", rates=RATES).hbm_bw == 5e9


def test_without_rates_the_cost_model_is_unchanged() -> None:
    plain = Topology(4, compute_device="cpu", local_world_size=2)
    assert plain.rates is None
    assert plain == Topology(4, compute_device="cpu", local_world_size=2, rates=None)
    assert plan({"t0": "table_wise"}, None).stats == plan({"t0": "table_wise"}, None).stats


def test_calibrated_shard_cost_adds_the_kernel_fixed_cost() -> None:
    spec = table_specs(find_tables(ebc()), {}, 4)[0]
    # the default memory rate, and row_wise's output at the between-host rate the default model charges
    same_bw = replace(RATES, memory_bw=Topology(4, compute_device="cpu").ddr_bw, reduce_scatter_bw=2.5e8)
    base = Workload(
        topology=Topology(4, compute_device="cpu", local_world_size=2, intra_host_bw=6e8, inter_host_bw=2.5e8),
        batch_size=64,
    )
    calibrated = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2, rates=same_bw), batch_size=64)
    for kind in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE):
        got = shard_perf(spec, calibrated, kind, spec.rows, spec.dim)
        assert got == pytest.approx(shard_perf(spec, base, kind, spec.rows, spec.dim) + RATES.lookup_seconds)
    # row_wise: the reduce-scatter of the pooled partial and its all-gather at the measured rate
    slow_rs = Workload(
        topology=Topology(4, compute_device="cpu", local_world_size=2, rates=replace(same_bw, reduce_scatter_bw=1e8)),
        batch_size=64,
    )
    partial = 4 * 64 * 1 * spec.dim * 4  # [global batch, dim] fp32
    rs = shard_perf(spec, calibrated, ShardingType.ROW_WISE, spec.rows // 4, spec.dim)
    assert shard_perf(spec, slow_rs, ShardingType.ROW_WISE, spec.rows // 4, spec.dim) - rs == pytest.approx(
        2 * partial * 3 / 4 * (1 / 1e8 - 1 / 2.5e8)
    )


def test_data_parallel_cost_follows_the_table_size_and_the_measured_rates() -> None:
    """A replicated table: lookup, the ring all-reduce of its gradient, and its dense update, each at its rate."""
    spec = table_specs(find_tables(ebc()), {}, 4)[0]  # 10_000 x 64
    work = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2, rates=RATES), batch_size=64)
    table = spec.rows * spec.dim * 4
    ids = 64 * spec.ids_per_sample  # this rank's batch only
    expected = (
        RATES.lookup_seconds
        + 2 * ids * spec.dim * 4 / RATES.memory_bw
        + 2 * 3 / 4 * table / RATES.allreduce_bw
        + table / RATES.dense_bw
    )
    assert shard_perf(spec, work, ShardingType.DATA_PARALLEL, spec.rows, spec.dim) == pytest.approx(expected)
    # twice the rows: the all-reduce and the dense update double, the lookup does not
    twice = shard_perf(spec, work, ShardingType.DATA_PARALLEL, 2 * spec.rows, spec.dim)
    assert twice - expected == pytest.approx(2 * 3 / 4 * table / RATES.allreduce_bw + table / RATES.dense_bw)


@pytest.mark.parametrize(
    ("kinds", "calls"),
    [
        # one mechanism: the header, the packed ids (lengths + values), output and gradient; DDP's
        ({"t0": "table_wise", "t1": "column_wise", "t2": "table_wise"}, Calls(all_to_all=4, all_reduce=1)),
        # row_wise: the packed ids, the output reduce-scattered and its gradient all-gathered
        (
            {"t0": "row_wise", "t1": "row_wise", "t2": "row_wise"},
            Calls(all_to_all=2, reduce_scatter=1, all_gather=1, all_reduce=1),
        ),
        # table_row_wise and grid_shard share one mechanism: + the holders' two in-host all-to-alls
        (
            {"t0": "grid_shard", "t1": "table_row_wise", "t2": "table_row_wise"},
            Calls(all_to_all=4, host_all_to_all=2, all_reduce=1),
        ),
        # three mechanisms, one packed exchange of their ids; data_parallel tables only join DDP's all-reduce
        (
            {"t0": "row_wise", "t1": "table_wise", "t2": "data_parallel"},
            Calls(all_to_all=4, reduce_scatter=1, all_gather=1, all_reduce=1),
        ),
        (dict.fromkeys(("t0", "t1", "t2"), "data_parallel"), Calls(all_to_all=1, all_reduce=1)),
    ],
)
def test_step_calls_are_derived_per_mechanism_from_the_plan(kinds: dict[str, str], calls: Calls) -> None:
    p = plan(kinds)
    assert step_calls(p, 2) == calls
    assert collectives(p, 2) == calls - BASE_CALLS == calls - Calls(all_to_all=1, all_reduce=1)


def test_host_all_to_alls_need_several_ranks_per_host_and_replicated_tables_fill_ddp_buckets() -> None:
    one_per_host = plan(dict.fromkeys(("t0", "t1", "t2"), "table_row_wise"), local=1)
    assert step_calls(one_per_host, 1) == Calls(all_to_all=4, all_reduce=1)
    big = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=300_000, embedding_dim=64, name="big", feature_names=["f"])], device="meta"
    )
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=RATES)
    cons = {"big": ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"])}
    p = EmbeddingShardingPlanner(topo, batch_size=64, constraints=cons).plan(big)
    assert -(-300_000 * 64 * 4 // DDP_BUCKET_BYTES) == 3
    assert step_calls(p, 2) == Calls(all_to_all=1, all_reduce=3)


def test_step_estimate_adds_the_fixed_step_calls_groups_and_tables() -> None:
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=RATES)
    one_type = plan({"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"})
    assert groups(one_type) == 1
    # beyond the fixed step: the packed ids and table-wise's 2 all-to-alls; 2 further tables
    assert step_estimate(one_type, topo) == pytest.approx(critical_path(one_type, RATES) + 5e-3 + 3 * 5e-4 + 2 * 2e-4)
    mixed = plan({"t0": "table_row_wise", "t1": "row_wise", "t2": "table_wise"})
    assert groups(mixed) == 3
    beyond = collectives(mixed, 2)
    assert beyond == Calls(all_to_all=1 + 2 + 2, host_all_to_all=2, reduce_scatter=1, all_gather=1)
    assert calls_seconds(beyond, RATES) == pytest.approx(5 * 5e-4 + 2 * 7e-4 + 2 * 2e-3)
    assert step_estimate(mixed, topo) == pytest.approx(
        critical_path(mixed, RATES) + 5e-3 + calls_seconds(beyond, RATES) + 2 * 3e-3 + 2 * 2e-4
    )
    # a replicated-only plan makes no call beyond the fixed step's (whose table is replicated)
    replicated = plan(dict.fromkeys(("t0", "t1", "t2"), "data_parallel"))
    assert collectives(replicated, 2) == Calls()
    assert step_estimate(replicated, topo) == pytest.approx(critical_path(replicated, RATES) + 5e-3 + 2 * 2e-4)
    assert groups(replicated) == 0
    # a replicated table beside a sharded group: looked up locally, no further group
    beside = plan({"t0": "table_wise", "t1": "table_wise", "t2": "data_parallel"})
    assert groups(beside) == 1
    assert step_estimate(beside, topo) == pytest.approx(critical_path(beside, RATES) + 5e-3 + 3 * 5e-4 + 2 * 2e-4)
    with pytest.raises(ValueError, match=r"step_estimate: the topology has no measured rates; build it with"):
        step_estimate(mixed, Topology(4, compute_device="cpu", local_world_size=2))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"memory_bw": 0.0}, r"Rates: memory_bw must be a finite number > 0, got 0.0"),
        ({"collective_seconds": -1.0}, r"Rates: collective_seconds must be a finite number >= 0, got -1.0"),
        ({"allreduce_bw": float("nan")}, r"Rates: allreduce_bw must be a finite number > 0, got nan"),
        ({"ranks_per_core": 0.5}, r"Rates: ranks_per_core must be a number >= 1, got 0.5"),
    ],
)
def test_bad_rates_are_named(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Rates(**{**asdict(RATES), **change})


def test_bad_rates_files_are_named(tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**asdict(RATES), "nic_bw": 1.0}))
    with pytest.raises(ValueError, match=r"r.json: unknown keys \['nic_bw'\]; valid: \["):
        Rates.load(path)
    data = asdict(RATES)
    del data["memory_bw"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"r.json: missing keys \['memory_bw'\]"):
        Rates.load(path)
    data = {k: v for k, v in asdict(RATES).items() if k not in ("ranks_per_core", "host_table_seconds", "source")}
    path.write_text(json.dumps(data))  # an older file: one rank per core, no host piece term
    assert Rates.load(path) == replace(RATES, source="")
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"r.json: expected a JSON object, got list"):
        Rates.load(path)
    with pytest.raises(TypeError, match=r"Topology: rates must be a Rates or a path to a rates file, got int"):
        Topology(2, compute_device="cpu", rates=3)  # type: ignore[arg-type]


def test_a_phase_lasts_as_long_as_its_slowest_rank_and_shared_cores_are_derived() -> None:
    assert phase_seconds("output/row_wise", [1.0, 3.0, 0.0, 0.0], 2.0) == 3.0  # a collective: no sharing
    assert phase_seconds("lookup/row_wise", [1.0, 3.0, 0.0, 0.0], 1.0) == 3.0
    # 2 ranks per core: one rank computing alone runs twice as fast as at the shared (measured) rate ...
    assert phase_seconds("lookup/row_wise", [4.0, 0.0, 0.0, 0.0], 2.0) == 2.0
    # ... but all ranks computing at once run at the shared rate (the mean bounds it)
    assert phase_seconds("update/table_wise", [2.0, 2.0, 2.0, 2.0], 2.0) == 2.0
    assert phase_seconds("update/table_wise", [4.0, 4.0, 2.0, 2.0], 2.0) == 3.0


def test_the_critical_path_sums_each_phase_slowest_rank() -> None:
    mixed = plan({"t0": "table_row_wise", "t1": "row_wise", "t2": "table_wise"})
    phases = mixed.stats.phase_cost
    assert {name.split("/")[1] for name in phases} == {
        "row_wise",
        "grid_shard+table_row_wise",
        "column_wise+table_wise",
    }
    # every rank's phases add up to the planner's per-rank cost
    per_rank = [sum(v[r] for v in phases.values()) for r in range(4)]
    assert per_rank == pytest.approx(list(mixed.stats.rank_cost), rel=1e-12)
    path = sum(max(v) for v in phases.values())
    assert critical_path(mixed, RATES) == pytest.approx(path)
    # different ranks are slowest in different phases: longer than the slowest rank's total
    assert path > mixed.stats.max_cost * 1.01
    shared = replace(RATES, ranks_per_core=2.0)
    assert critical_path(mixed, shared) == pytest.approx(sum(phase_seconds(name, v, 2.0) for name, v in phases.items()))
    assert critical_path(mixed, shared) < path
    assert ShardingPlan.from_json(mixed.to_json()).stats.phase_cost == phases


def test_plans_without_rates_record_no_phases() -> None:
    plain = plan({"t0": "table_row_wise", "t1": "row_wise", "t2": "table_wise"}, rates=None)
    assert plain.stats.phase_cost == {}
    assert "phase_cost" not in plain.to_json()
    assert critical_path(plain, RATES) == plain.stats.max_cost


def test_further_pieces_count_column_pieces_and_host_pieces_add_their_own() -> None:
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=replace(RATES, host_table_seconds=1e-3))
    tw = plan({"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"})
    assert pieces(tw) == (3, 0)
    cw = plan({"t0": "column_wise", "t1": "table_wise", "t2": "table_wise"})
    cuts = len({s.shard_offsets[1] for s in cw.plan[""]["t0"].shards})
    assert cuts > 1
    assert pieces(cw) == (cuts + 2, 0)
    assert step_estimate(cw, topo) - step_estimate(tw, topo) == pytest.approx(
        critical_path(cw, RATES) - critical_path(tw, RATES) + (cuts - 1) * 2e-4
    )
    host = plan(dict.fromkeys(("t0", "t1", "t2"), "table_row_wise"))
    assert pieces(host) == (3, 3)
    no_host = step_estimate(host, Topology(4, compute_device="cpu", local_world_size=2, rates=RATES))
    assert step_estimate(host, topo) == pytest.approx(no_host + 2 * 1e-3)
    replicated = plan(dict.fromkeys(("t0", "t1", "t2"), "data_parallel"))
    assert pieces(replicated) == (3, 0)


@pytest.mark.parametrize("rates", [None, RATES, replace(RATES, row_seconds=1e-7)])
@pytest.mark.parametrize("kind", list(ShardingType))
def test_a_shards_phases_add_up_to_its_cost(kind: ShardingType, rates: Rates | None) -> None:
    from lightning_shardrec.planner.costs.perf import shard_phases

    spec = table_specs(find_tables(ebc()), {}, 4)[0]
    work = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2, rates=rates), batch_size=64)
    rows = spec.rows if kind in (ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL) else spec.rows // 2
    parts = shard_phases(spec, work, kind, rows, spec.dim)
    assert parts and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(shard_perf(spec, work, kind, rows, spec.dim), rel=1e-12)


def test_distinct_rows_of_uniform_ids() -> None:
    from lightning_shardrec.planner.costs.perf import distinct_rows

    assert distinct_rows(0, 100) == 0.0 and distinct_rows(5, 0) == 0.0
    assert distinct_rows(4096, 4) == pytest.approx(4.0)  # every row, many times over
    assert distinct_rows(10, 10**9) == pytest.approx(10.0, rel=1e-6)  # every id its own row
    # against counting: 4096 uniform ids over 65,536 rows
    import torch

    gen = torch.Generator().manual_seed(0)
    counted = [torch.randint(0, 65_536, (4096,), generator=gen).unique().numel() for _ in range(20)]
    assert distinct_rows(4096, 65_536) == pytest.approx(sum(counted) / len(counted), rel=0.01)


@pytest.mark.parametrize("kind", [ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE])
def test_a_shard_pays_per_distinct_row(kind: ShardingType) -> None:
    """Calibrated with ``row_seconds``: a shard pays each distinct row it touches, in a phase of its own,
    whatever its width (a column piece misses on its own rows); a table of few rows pays for those few."""
    from lightning_shardrec.planner.costs.perf import Phase, distinct_rows, shard_phases

    spec = table_specs(find_tables(ebc()), {}, 4)[0]  # 10_000 x 64, pooling 1
    rates = replace(RATES, row_seconds=1e-7)
    work = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2, rates=rates), batch_size=64)
    flat = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2, rates=RATES), batch_size=64)
    rows = spec.rows if kind is ShardingType.TABLE_WISE else spec.rows // 2
    ids = 4 * 64 * rows / spec.rows  # the global batch's ids that fall in the shard
    extra = distinct_rows(ids, rows) * 1e-7
    for cols in (64, 16):
        got, want = shard_phases(spec, work, kind, rows, cols), shard_phases(spec, flat, kind, rows, cols)
        assert got.pop(Phase.ROWS) == pytest.approx(extra) and Phase.ROWS not in want
        assert got == want
        assert shard_perf(spec, work, kind, rows, cols) - shard_perf(spec, flat, kind, rows, cols) == pytest.approx(
            extra
        )
    assert shard_phases(spec, work, kind, 4, 64)[Phase.ROWS] <= 4 * 1e-7


def test_every_rank_pays_its_rows_at_the_shared_rate() -> None:
    """Distinct rows are not sped up by ranks that wait: a phase of rows lasts as long as its slowest rank."""
    assert phase_seconds("rows/column_wise+table_wise", (4.0, 1.0, 0.0, 0.0), 2.0) == 4.0
    assert phase_seconds("update/column_wise+table_wise", (4.0, 1.0, 0.0, 0.0), 2.0) == 2.0
