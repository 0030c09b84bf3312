"""``benchmarks/e2e_bench.py``: its arithmetic, its docs section, and a ``--quick`` run.

No timing is checked: the machines are shared and noisy. The quick run starts every
non-TorchRec variant in fresh processes (torch + Lightning imports per rank), so it is
marked slow; TorchRec needs its own venv and is left to ``make bench``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("e2e_bench", BENCH / "e2e_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("e2e_bench", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_windows_use_the_slowest_rank():
    e2e = _load()
    ranks = [
        {"batch_size": 100, "step_seconds": [0.1, 0.1, 0.1, 0.1]},
        {"batch_size": 100, "step_seconds": [0.2, 0.2, 0.1, 0.1]},
    ]
    # window 2: rank 1 takes 0.4 s then 0.2 s for 2 steps x 200 samples
    assert e2e.windows(ranks, 2) == pytest.approx([1000.0, 2000.0])
    assert e2e.whole(ranks) == pytest.approx(800 / 0.6)


def test_cpu_per_rank_is_main_plus_other_threads_median_over_rounds():
    e2e = _load()
    rounds = [
        [{"rank": 0, "cpu_ms": {"main": 20.0, "other threads": 3.0}}, {"rank": 1, "cpu_ms": {"main": 22.0}}],
        [{"rank": 0, "cpu_ms": {"main": 24.0, "other threads": 5.0}}, {"rank": 1, "cpu_ms": {"main": 26.0}}],
        [{"rank": 0, "cpu_ms": {"main": 21.0, "other threads": 4.0}}, {"rank": 1, "cpu_ms": {}}],
    ]
    assert e2e.cpu_per_rank(rounds) == "21.0+4.0 / 24.0+0.0"
    assert e2e.cpu_per_rank([[{"rank": 0, "cpu_ms": {}}]]) == "-"  # results of a run without /proc


def test_same_losses_compares_every_rank_and_step_of_the_last_round_with_dmp_plain():
    e2e = _load()

    def run(*per_rank: list[float]) -> list[list[dict[str, object]]]:
        old = [{"rank": r, "losses": [9.0] * len(x)} for r, x in enumerate(per_rank)]  # an earlier round
        return [old, [{"rank": r, "losses": x} for r, x in reversed(list(enumerate(per_rank)))]]

    runs = {
        "dmp_plain": run([0.7, 0.6], [0.8, 0.5]),
        "shardrec_pg": run([0.7, 0.6], [0.8, 0.5]),
        "shardrec_pg_pipeline": run([0.7, 0.6], [0.8, 0.25]),
        "shardrec": [],  # did not run
    }
    line = e2e.same_losses(runs)
    assert "shardrec_pg 0.0e+00" in line and "shardrec_pg_pipeline 2.5e-01" in line and "shardrec " not in line
    assert "did not run" in e2e.same_losses({"dmp_plain": [], "shardrec_pg": runs["shardrec_pg"]})


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="per-thread CPU is read from /proc")
def test_step_timer_counts_cpu_per_timed_step():
    """CPU of the timed steps only (after the warm-up), per step, main thread and the others."""
    import threading
    import time

    sys.path.insert(0, str(BENCH))
    from _e2e_common import StepTimer

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def helper(done: threading.Event) -> None:  # as gloo's threads: alive for the whole run
        spin(0.04)
        done.wait()

    timer = StepTimer(warmup=1)
    timer.tick()
    spin(0.2)  # warm-up: not counted
    done = threading.Event()
    for _ in range(2):
        timer.tick()
        if not done.is_set() and not any(t.name == "helper" for t in threading.enumerate()):
            threading.Thread(target=helper, args=(done,), name="helper").start()
        spin(0.05)
    timer.tick()
    timer.finish()
    done.set()
    assert len(timer.seconds) == 2 and set(timer.cpu_ms) == {"main", "other threads"}
    assert 0.05e3 <= timer.cpu_ms["main"] < 0.2e3  # at least its own spin, never the warm-up's
    assert timer.cpu_ms["other threads"] >= 0.02e3


def test_write_section_keeps_other_sections_machines_and_the_reading(tmp_path, monkeypatch):
    e2e = _load()
    doc = tmp_path / "b.md"
    doc.write_text(
        "# Benchmarks\n\n## Kernels\n\nk\n\n## End-to-end training\n\nintro\n\n### Other CPU (AVX2)\n\n"
        "theirs\n\nReading: theirs\n\n## Later\n\nz\n"
    )
    monkeypatch.setattr(e2e, "machine_heading", lambda: "This CPU (AVX-512)")
    e2e.write_section(doc, "## End-to-end training\n\nold figures\n")
    doc.write_text(doc.read_text().replace("old figures\n", "old figures\n\nReading: mine\n"))
    e2e.write_section(doc, "## End-to-end training\n\nnew figures\n")
    text = doc.read_text()
    assert "## Kernels\n\nk\n" in text and "## Later\n\nz\n" in text
    # the other machine's part stays beside this machine's, which is replaced (its reading kept)
    assert "### Other CPU (AVX2)\n\ntheirs\n\nReading: theirs\n" in text
    assert "### This CPU (AVX-512)\n\nnew figures\n\nReading: mine\n" in text
    assert "old figures" not in text and text.index("theirs") < text.index("new figures") < text.index("## Later")


@pytest.mark.slow
def test_e2e_bench_quick_runs_every_local_variant(tmp_path):
    plot = tmp_path / "e2e.png"
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "e2e_bench.py"),
            "--quick",
            "--variants",
            "shardrec,shardrec_pipeline,dmp_plain,ddp_sparse,kernel_floor,kernel_floor_torch",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    assert text.startswith("## End-to-end training")
    for v in ("shardrec", "dmp_plain", "ddp_sparse", "kernel_floor", "kernel_floor_torch"):
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {v} |"))
        assert "not run" not in row, row
    assert "| shardrec_pipeline |" in text  # the slot is kept
    assert "shardrec / floor (fbgemm) = " in text or "shardrec / floor (torch) = " in text
    assert "kernel_floor_torch / kernel_floor = " in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
