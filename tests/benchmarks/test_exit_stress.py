"""benchmarks/exit_stress.py: fit + save_checkpoint on 2 fresh ranks next to a CPU hog, a few
times; every rank must exit 0 (the full 100-run figure is in docs/reliability.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "exit_stress.py"


@pytest.mark.slow
def test_exit_stress_runs_exit_cleanly(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "2", "--hogs", "1", "--steps", "2", "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        check=False,
    )
    assert "exit_stress: 2 runs, 0 abnormal exits" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0
    assert out.stdout.count("exit codes [0, 0]") == 2
