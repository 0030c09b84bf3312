"""The calibration's fit (``benchmarks/_calibrate_probes.step_parts``) recovers the in-step rates from
probe steps that the cost model itself predicts, whatever the machine's drift between rounds."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _calibrate_probes import PROBES, probe_plan, step_parts  # noqa: E402
from _calibrate_runs import LOCAL, WORLD  # noqa: E402

from lightning_shardrec.planner import Rates, Topology, step_estimate  # noqa: E402

#: the in-step figures, which ``measure`` leaves at 0 for the probes to find
IN_STEP = (
    "step_seconds",
    "collective_seconds",
    "host_call_seconds",
    "reduce_scatter_seconds",
    "group_seconds",
    "table_seconds",
)
#: what ``measure`` found alone
ALONE = Rates(
    **dict(memory_bw=1.1e10, lookup_seconds=1.8e-4, intra_host_bw=5e8, inter_host_bw=9e8),
    **dict(reduce_scatter_bw=7.8e8, allreduce_bw=6e8, dense_bw=2.4e8, ranks_per_core=2.0),
    **dict.fromkeys(IN_STEP, 0.0),
)
#: the machine inside a step: what the fit must find
TRUTH = replace(
    ALONE,
    **{bw: getattr(ALONE, bw) / 1.5 for bw in ("intra_host_bw", "inter_host_bw")},  # all-to-alls 1.5x slower
    **{bw: getattr(ALONE, bw) / 0.7 for bw in ("dense_bw", "allreduce_bw")},  # replicated tables 0.7x
    **dict(zip(IN_STEP, (8e-3, 1.1e-3, 0.9e-3, 3e-3, 2e-3, 3e-4), strict=True)),
    **dict(host_table_seconds=2e-4, row_seconds=5e-7, row_byte_seconds=1e-9),
)
DRIFT = [0.0, 4e-3, -2e-3, 9e-3, 1e-3]  # per round, every probe alike: the machine's load moving


def steps(rates: Rates) -> list[dict[str, list[list[float]]]]:
    """Per rank, per probe, per round, 3 steps of the step ``rates`` predict (plus the round's drift)."""
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=rates)
    predicted = {name: step_estimate(probe_plan(name, topo)[1], topo) for name in PROBES}
    return [{name: [[s + d] * 3 for d in DRIFT] for name, s in predicted.items()} for _ in range(WORLD)]


def test_the_fit_recovers_the_in_step_rates_the_steps_were_made_with() -> None:
    fitted = step_parts(ALONE, steps(TRUTH))
    for name, value in fitted.items():
        want = getattr(TRUTH, name) + (sorted(DRIFT)[2] if name == "step_seconds" else 0.0)
        assert value == pytest.approx(want, rel=0.01, abs=1e-5), name


def test_a_fit_that_charges_nothing_more_finds_nothing_more() -> None:
    fitted = step_parts(ALONE, steps(replace(ALONE, step_seconds=5e-3)))
    assert fitted["step_seconds"] == pytest.approx(5e-3 + sorted(DRIFT)[2])
    for name in (
        "collective_seconds",
        "reduce_scatter_seconds",
        "group_seconds",
        "table_seconds",
        "row_seconds",
        "row_byte_seconds",
    ):
        assert fitted[name] == pytest.approx(0.0, abs=1e-6), name
    assert fitted["dense_bw"] == pytest.approx(ALONE.dense_bw, rel=1e-6)
