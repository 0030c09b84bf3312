"""A rank that dies (SIGKILL) or hangs (SIGSTOP) mid-epoch: the others exit promptly naming it,
and ``fit(ckpt_path="last")`` continues with no update lost or applied twice.

Each run is a real 2-rank job started by Lightning's own subprocess launcher
(``_fault_run.py``); every run is bounded by a subprocess timeout.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_fault_run.py")
BOUND_S = 240


def run(forked_python, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python _fault_run.py out *args`` (this session's environment, unbuffered: ``forked_python``)."""
    out.mkdir(exist_ok=True)
    started = time.time()
    proc = forked_python.run([SCRIPT, out, *args], cwd=SCRIPT.parent, timeout=BOUND_S)
    return proc, time.time() - started


def detect_seconds(out: Path, ended: float) -> float:
    return ended - float((out / "fault_at").read_text())


@pytest.mark.slow
def test_dead_rank_is_named_and_resume_loses_nothing(tmp_path, forked_python):
    killed, _ = run(forked_python, tmp_path / "a", "--fault", "kill", "--rank", "1", "--step", "7")
    ended = time.time()
    assert killed.returncode != 0
    assert "lightning_shardrec: rank 1 died" in killed.stdout + killed.stderr, killed.stderr[-3000:]
    assert detect_seconds(tmp_path / "a", ended) < 30  # the gloo timeout alone would be 10 minutes
    assert not (tmp_path / "a" / "final.pt").exists()

    resumed, _ = run(forked_python, tmp_path / "a", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "a" / "ran").read_text() == "5"  # steps 5..9 from the step-5 checkpoint, none redone
    straight, _ = run(forked_python, tmp_path / "b")
    assert straight.returncode == 0, straight.stderr[-3000:]
    got = torch.load(tmp_path / "a" / "final.pt", weights_only=True)
    want = torch.load(tmp_path / "b" / "final.pt", weights_only=True)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.slow
def test_hung_rank_is_named_by_the_heartbeat_watchdog(tmp_path, forked_python):
    hung, _ = run(forked_python, tmp_path, "--fault", "stop", "--rank", "1", "--step", "3", "--heartbeat-timeout", "4")
    ended = time.time()
    assert hung.returncode != 0
    assert "lightning_shardrec: rank 1 stopped (no heartbeat for" in hung.stdout + hung.stderr, hung.stdout[-3000:]
    assert detect_seconds(tmp_path, ended) < 30


@pytest.mark.parametrize("report_finishes", [True, False])
def test_a_declaration_during_a_failure_report_exits_only_if_the_report_is_stuck(monkeypatch, report_finishes):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.lightning.failures import rank_failures

    class Stopped:
        def stop(self) -> None:
            pass

    exits: list[int] = []
    monkeypatch.setattr(rank_failures, "_GRACE_S", 0.2)
    monkeypatch.setattr(rank_failures.os, "_exit", exits.append)
    strategy = ShardRecStrategy()
    strategy.monitor, strategy._failing = Stopped(), True  # the main thread is reporting a failure
    strategy._on_dead_rank(0, "is unreachable on host 'node-a' (ranks 0, 1)")
    assert exits == []  # not at once: the report goes first
    if report_finishes:
        strategy.stop_monitor()  # teardown after the report
    time.sleep(1.0)
    assert exits == ([] if report_finishes else [1])
