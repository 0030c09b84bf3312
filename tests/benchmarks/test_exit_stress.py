"""benchmarks/exit_stress.py: one fit of each kind (Lightning, Lightning with the pipeline, a TorchRec-style
program ending in destroy_process_group without a barrier) and one pytest session, then a Fabric script launched
both ways, next to a CPU hog; every process must exit 0 without 'terminate called' (the figures are in
docs/reliability.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "exit_stress.py"
SESSION = "tests/lightning/test_exit_hook.py::test_shutdown_stops_monitors_and_frees_the_cached_groups"


@pytest.mark.slow
def test_exit_stress_runs_exit_cleanly(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--fits", "3", "--sessions", "1", "--tests", SESSION, "--steps", "2"]
    cmd += ["--hogs", "1", "--hog-limit", "900", "--timeout", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path, check=False)
    text = out.stdout[-3000:] + out.stderr[-3000:]
    assert "exit_stress: 3 fits, 1 sessions, 0 abnormal, 0 'terminate called'" in out.stdout, text
    assert "(lightning 0/1, pipeline 0/1, dmp 0/1, session 0/1)" in out.stdout, text
    assert out.stdout.count("exit codes [0, 0]") == 3, text
    assert "session 1/1: exit code 0" in out.stdout, text
    assert out.returncode == 0


@pytest.mark.slow
def test_fabric_scripts_exit_cleanly_without_teardown(tmp_path):
    """A Fabric script that never calls ``teardown`` (its Fabric object, model and optimizer referenced to the
    end), started with torchrun's variables and started alone (``python script.py``, Fabric's launcher)."""
    cmd = [sys.executable, str(SCRIPT), "--kinds", "fabric,fabric_launch", "--fits", "2", "--sessions", "0"]
    cmd += ["--steps", "2", "--hogs", "1", "--hog-limit", "900", "--timeout", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False)
    text = out.stdout[-3000:] + out.stderr[-3000:]
    summary = "exit_stress: 2 fits, 0 sessions, 0 abnormal, 0 'terminate called' (fabric 0/1, fabric_launch 0/1)"
    assert summary in out.stdout, text
    assert "fit 1/2 (fabric): exit codes [0, 0]" in out.stdout, text
    assert "fit 2/2 (fabric_launch): exit codes [0]" in out.stdout, text
    assert out.returncode == 0
