"""The benchmark scripts' ``--quick`` paths run end to end (no timings are checked)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _forked_python import ForkedPython

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def run_quick(forked_python: ForkedPython, script: str) -> str:
    """``python benchmarks/<script> --quick`` (forked: :class:`ForkedPython`): its stdout, once it exited 0."""
    out = forked_python.run([BENCH / script, "--quick"], cwd=Path.cwd(), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@pytest.mark.needs_fbgemm  # the benchmark measures fbgemm's kernels against torch's
def test_kernel_bench_quick(forked_python):
    text = run_quick(forked_python, "kernel_bench.py")
    assert text.startswith("## Kernels")
    for case in (
        "fbgemm sgd",
        "fbgemm rowwise_adagrad",
        "torch sgd",
        "torch rowwise_adagrad",
        "torch adam",
    ):
        assert f"fwd+bwd+update {case} |" in text
    assert "`validate_ids`" in text
    assert "rowwise_adagrad: fbgemm (" in text or "rowwise_adagrad: torch (" in text  # kernel="auto"'s choice


@pytest.mark.slow
def test_memory_bench_quick(forked_python):
    text = run_quick(forked_python, "memory_bench.py")
    assert text.startswith("## Sharded memory")
    rows = [ln for ln in text.splitlines() if ln.startswith(("| table_wise |", "| row_wise |"))]
    assert len(rows) == 8  # 2 optimizer configs x 2 plans x 2 ranks
    # each rank holds exactly half of tables + state
    assert all("| 1.0000 |" in ln for ln in rows)


@pytest.mark.slow
def test_trainer_memory_bench_quick(forked_python):
    out = run_quick(forked_python, "trainer_memory_bench.py")  # the ranks print their plans first
    text = out[out.index("## Memory per phase through the Trainer") :]
    rows = [ln for ln in text.splitlines() if ln.startswith(("| 2 ranks | ", "| 3 ranks (resumed from 2) | "))]
    assert len(rows) == 2 + 3 + 2  # per rank of each run, then the estimate of each run


def test_quant_bench_quick(forked_python):
    text = run_quick(forked_python, "quant_bench.py")
    assert text.startswith("## Quantized inference")
    for case in ("| int8 |", "| int4 |", "| fp16 |", "| int8 + dense int8 |", "| int8 torch |"):
        assert case in text


@pytest.mark.slow
def test_deferred_bench_quick(forked_python):
    text = run_quick(forked_python, "deferred_bench.py")
    assert "\n## Deferred table updates (accumulation, norm clipping)\n" in text  # after the ranks' plan printouts
    for variant in ("in backward, kernel=torch", "deferred: gradient_clip_val=1.0 (norm), k=1",
                    "deferred: accumulate_grad_batches=4", "in backward", "deferred, k=4"):  # fmt: skip
        assert f"\n| {variant} | " in text, variant


def test_comm_share_quick(forked_python):
    text = run_quick(forked_python, "comm_share.py")
    assert "2 ranks: median step" in text
    for site in ("header", "ids", "pooled", "grads"):
        assert f"  {site} " in text
