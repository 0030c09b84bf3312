"""``python -m lightning_shardrec.gpu_check [OUT] [--cpu]``: run every check, write the report, exit 1 on a failure."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from lightning_shardrec import _fbgemm as fbgemm
from lightning_shardrec.gpu_check.env import Mode
from lightning_shardrec.gpu_check.report import Check, Report, Status

OUT_ENV = "GPU_CHECK_OUT"
DEFAULT_OUT = "gpu_check_report"
NOT_ON_ONE_GPU = [
    (
        "multi-rank NCCL",
        "sharded all-to-alls, reduce-scatters and DDP over NCCL need 2+ GPUs (then the multi-rank "
        "section runs, one process per GPU); CPU CI covers them with gloo, and the one-GPU runs here "
        "use a one-rank group",
    ),
    ("same-host shared-memory transport", "gloo groups of several CPU ranks only"),
]


def _sections() -> list[tuple[str, Callable[[Report, Mode], None]]]:
    from lightning_shardrec.gpu_check.collections import check_collections
    from lightning_shardrec.gpu_check.perf import check_speed
    from lightning_shardrec.gpu_check.trainer import check_lightning_overhead, check_strategy

    return [
        ("collections", check_collections),
        ("strategy", check_strategy),
        ("speed, syncs, memory", check_speed),
        ("Lightning's overhead", check_lightning_overhead),
    ]


def run(out: Path, force_cpu: bool = False) -> Report:
    mode = Mode.detect(force_cpu)
    print(f"gpu-check: {'CUDA' if mode.cuda else 'CPU'} mode on {mode.describe()}; report to {out}", flush=True)
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    env["lightning"] = metadata.version("lightning")  # a dependency; read without importing Lightning here
    env["fbgemm"] = fbgemm.describe()  # the build, whether it loads with this torch, the backend chosen
    print(f"gpu-check: torch {torch.__version__}, lightning {env['lightning']}; {env['fbgemm']}", flush=True)
    report = Report("cuda" if mode.cuda else "cpu", mode.describe(), env)
    for name, section in _sections():
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                section(report, mode)
        except Exception as e:  # a crashed section is a failed check, and the next one still runs
            where = traceback.format_exc(limit=-3).strip().splitlines()
            report.add(Check(name, "ran to the end", Status.FAIL, f"{type(e).__name__}: {e}", {"traceback": where}))
        print(f"gpu-check: {name} took {time.perf_counter() - t0:.1f} s", flush=True)
        report.write(out)  # after every section: a run killed later still leaves what it found
    from lightning_shardrec.gpu_check.multi import MultiMode, check_multi

    not_here = list(NOT_ON_ONE_GPU)
    multi = MultiMode.detect()  # 2+ GPUs (or the CPU test flag): one process per device
    if multi is not None:
        print(f"gpu-check: multi-rank mode on {multi.describe()}", flush=True)
        t0 = time.perf_counter()
        try:
            check_multi(report, multi)
        except Exception as e:
            where = traceback.format_exc(limit=-3).strip().splitlines()
            report.add(
                Check("multi-rank", "ran to the end", Status.FAIL, f"{type(e).__name__}: {e}", {"traceback": where})
            )
        print(f"gpu-check: multi-rank took {time.perf_counter() - t0:.1f} s", flush=True)
        if multi.device_type == "cuda":
            not_here = [(what, why) for what, why in not_here if what != "multi-rank NCCL"]
    if not fbgemm.fbgemm_ops_on(mode.device.type):
        not_here.append(("fbgemm kernels", f"{env['fbgemm']}: every run here uses the torch kernel"))
    for what, why in not_here:
        report.add(Check("not checked here", what, Status.NOT_CHECKED, why))
    json_path, md_path = report.write(out)
    print(f"gpu-check: {len(report.failed)} failed of {len(report.checks)}; wrote {json_path} and {md_path}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_shardrec.gpu_check", description=__doc__)
    p.add_argument("out", nargs="?", help=f"report folder (default ${OUT_ENV}, else ./{DEFAULT_OUT})")
    p.add_argument("--cpu", action="store_true", help="the CPU mode even when a GPU is visible")
    a = p.parse_args(argv)
    out = Path(a.out or os.environ.get(OUT_ENV) or DEFAULT_OUT)
    report = run(out, a.cpu)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
