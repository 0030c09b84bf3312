"""Calibrated rates (``Topology(rates=...)``): opt-in, loaded from the file the calibration writes."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Rates,
    ShardingType,
    Topology,
    Workload,
    shard_perf,
    step_estimate,
)
from lightning_shardrec.planner.rates import COLLECTIVES_HOLDERS, COLLECTIVES_PER_TYPE, collectives
from lightning_shardrec.planner.tables import find_tables, table_specs

RATES = Rates(
    memory_bw=5e9,
    lookup_seconds=1e-4,
    intra_host_bw=6e8,
    inter_host_bw=2.5e8,
    collective_seconds=5e-4,
    allreduce_bw=4e8,
    step_seconds=5e-3,
    table_seconds=2e-4,
    source="test",
)


def ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
            for i, (n, d) in enumerate([(10_000, 64), (2_000, 32), (100, 16)])
        ],
        device="meta",
    )


def plan(kinds: dict[str, str], rates: Rates | None = RATES):
    topo = Topology(4, compute_device="cpu", local_world_size=2, rates=rates)
    cons = {t: ParameterConstraints(sharding_types=[k], pooling_factors=[4.0]) for t, k in kinds.items()}
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
    same_bw = replace(RATES, memory_bw=Topology(4, compute_device="cpu").ddr_bw)
    base = Workload(
        topology=Topology(4, compute_device="cpu", local_world_size=2, intra_host_bw=6e8, inter_host_bw=2.5e8),
        batch_size=64,
    )
    calibrated = Workload(topology=Topology(4, compute_device="cpu", local_world_size=2, rates=same_bw), batch_size=64)
    for kind in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE):
        got = shard_perf(spec, calibrated, kind, spec.rows, spec.dim)
        assert got == pytest.approx(shard_perf(spec, base, kind, spec.rows, spec.dim) + RATES.lookup_seconds)
    # data_parallel: the all-reduce runs at the measured all-reduce rate
    dp = shard_perf(spec, calibrated, ShardingType.DATA_PARALLEL, spec.rows, spec.dim)
    slower = Workload(
        topology=Topology(4, compute_device="cpu", local_world_size=2, rates=replace(same_bw, allreduce_bw=2e8)),
        batch_size=64,
    )
    ring = 2 * 3 / 4 * spec.rows * spec.dim * 4
    assert shard_perf(spec, slower, ShardingType.DATA_PARALLEL, spec.rows, spec.dim) - dp == pytest.approx(
        ring / 2e8 - ring / 4e8
    )


def test_step_estimate_counts_the_further_collectives_and_tables() -> None:
    one_type = plan({"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"})
    assert collectives(one_type) == 0
    assert step_estimate(one_type, RATES) == pytest.approx(one_type.stats.max_cost + 5e-3 + 2 * 2e-4)
    mixed = plan({"t0": "table_row_wise", "t1": "row_wise", "t2": "table_wise"})
    assert collectives(mixed) == 2 * COLLECTIVES_PER_TYPE + COLLECTIVES_HOLDERS
    assert step_estimate(mixed, RATES) == pytest.approx(
        mixed.stats.max_cost + 5e-3 + 2 * 2e-4 + RATES.collective_seconds * collectives(mixed)
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"memory_bw": 0.0}, r"Rates: memory_bw must be a finite number > 0, got 0.0"),
        ({"collective_seconds": -1.0}, r"Rates: collective_seconds must be a finite number >= 0, got -1.0"),
        ({"allreduce_bw": float("nan")}, r"Rates: allreduce_bw must be a finite number > 0, got nan"),
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
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"r.json: expected a JSON object, got list"):
        Rates.load(path)
    with pytest.raises(TypeError, match=r"Topology: rates must be a Rates or a path to a rates file, got int"):
        Topology(2, compute_device="cpu", rates=3)  # type: ignore[arg-type]
