"""The device check's CPU mode, run as CI runs it (so the GPU check never rots), and its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_shardrec.gpu_check import Check, Report, Status, run
from lightning_shardrec.gpu_check import runner as run_module

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_mode_runs_every_check_and_writes_the_report(tmp_path: Path) -> None:
    """``python -m lightning_shardrec.gpu_check`` from the checkout, report to ``$GPU_CHECK_OUT``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPU_CHECK_OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_shardrec.gpu_check"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith("gpu-check: CPU mode on CPU")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "cpu" and report["failed"] == 0
    by_section: dict[str, list[dict]] = {}
    for c in report["checks"]:
        by_section.setdefault(c["section"], []).append(c)
    assert set(by_section) == {"exactness", "speed", "syncs", "memory", "not checked here"}
    names = {c["name"] for c in by_section["exactness"]}
    for kind in ("pooled", "sequence", "weighted"):
        assert {f"{kind} {o}" for o in ("sgd", "adagrad", "adam", "adamw", "rowwise_adagrad")} <= names
    assert {"dynamic adam id -> slot state", "pipeline on vs off, 32"} <= names
    assert {f"strategy vs none, {p}" for p in ("32", "16-mixed", "bf16-mixed")} <= names
    assert all(c["status"] == "pass" for c in by_section["exactness"] + by_section["syncs"])
    syncs = {c["name"]: c["figures"]["total"] for c in by_section["syncs"]}
    assert 0 < syncs["static tables, one training step"] <= syncs["dynamic tables, one training step"]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# gpu-check report (CPU mode)") and "## exactness" in md and "multi-rank NCCL" in md


def test_a_failed_or_crashed_check_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(report: Report, mode: object) -> None:
        report.add(Check("exactness", "a bad one", Status.FAIL, "max |diff| 1.0"))

    def crashes(report: Report, mode: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(run_module, "_sections", lambda: [("fails", fails), ("crashes", crashes)])
    report = run(tmp_path, force_cpu=True)
    assert [(c.section, c.name) for c in report.failed] == [("exactness", "a bad one"), ("crashes", "ran to the end")]
    assert report.failed[1].detail == "RuntimeError: boom"
    assert json.loads((tmp_path / "report.json").read_text())["failed"] == 2
    monkeypatch.setenv("GPU_CHECK_OUT", str(tmp_path / "env"))
    assert run_module.main(["--cpu"]) == 1
    assert (tmp_path / "env" / "report.md").exists()


def test_cuda_syncs_counts_cudas_sync_warnings_by_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's sync debug mode warns once per synchronizing call; only those warnings count (faked here)."""
    import warnings

    import torch

    from lightning_shardrec.gpu_check import cuda_syncs

    modes: list[object] = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with cuda_syncs() as count:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert dict(count.kinds) == {"cuda": 2} and modes == ["warn", 0]
    ((site, n),) = count.sites.items()  # both from the one line that warned
    assert n == 2 and "test_gpu_check.py:" in site
