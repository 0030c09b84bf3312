"""The scale harness's figures per world size (issue 41): one user program at 2, 8, 16, ... ranks.

    python benchmarks/scale_harness.py [--worlds 2 8 16] [--steps 40] [--kill-at 8]

Each world size runs ``tests/lightning/_scale_run.py`` (``Trainer(strategy="shardrec")``, gloo,
tiny tables, 48 samples per global batch) as ``W`` processes launched the way torchrun would,
and prints per world size (the worst rank, or the median where it says so):

- **launch to first step**, and where it goes: process start (interpreter), imports (torch,
  Lightning, the library), setup (process group, planning, sharding: to ``on_fit_start``), the
  first step;
- **step**: the median step after the first two, and its overhead over the 2-rank step;
- **RSS per rank**: the resident peak (``VmHWM``), median and largest;
- **store operations per second**: what the health monitor sent the rendezvous store
  (:attr:`RankMonitor.store_ops` over the fit), per rank and all ranks together, and the steady
  rate per rank: the counter read after the second step and at the end of training, over the
  time between (set-up's operations left out);
- **detection** (``--kill-at W``): rank W/2+1 SIGKILLs itself before step 3; seconds from the
  kill until every survivor has exited naming it.

The machine is shared: print ``lscpu``'s model name and the load average with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "lightning"))

from _scale_run import launch  # noqa: E402

MiB = 2**20


def _machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in subprocess.check_output(["lscpu"], text=True).splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    return f"{model}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"


def measure(world: int, steps: int, root: Path) -> dict[str, float]:
    run = launch(world, root / f"fit{world}", "--steps", str(steps))
    bad = [r for r, c in enumerate(run.codes) if c != 0]
    if bad:
        raise RuntimeError(f"{world} ranks: ranks {bad} failed:\n{run.log(bad[0])[-3000:]}")
    ranks = [run.figures(r) for r in range(world)]
    launched = float(ranks[0]["launched"])  # type: ignore[arg-type]
    worst = {k: max(float(f[k]) - launched for f in ranks) for k in ("started", "imported", "fit_start", "first_step")}
    steps_ = [statistics.median(f["step"][2:]) for f in ranks]  # type: ignore[index]
    ops = [float(f["store_ops"]) / (float(f["train_end"]) - float(f["fit_start"])) for f in ranks]  # type: ignore[arg-type]
    windows = [
        (float(f["store_ops"]) - float(f["steady_ops"]), float(f["train_end"]) - float(f["steady_at"]))  # type: ignore[arg-type]
        for f in ranks
        if "steady_ops" in f
    ]
    peaks = [float(f["peak"]) for f in ranks]  # type: ignore[arg-type]
    return {
        "start": worst["started"],
        "imports": worst["imported"] - worst["started"],
        "setup": worst["fit_start"] - worst["imported"],
        "first": worst["first_step"] - worst["fit_start"],
        "to_first": worst["first_step"],
        "step": max(steps_),
        "rss_median": statistics.median(peaks) / MiB,
        "rss_max": max(peaks) / MiB,
        "ops_rank": statistics.median(ops),
        "ops_total": sum(ops),
        "ops_steady": statistics.median(n / dt for n, dt in windows) if windows else float("nan"),
        "steady_s": statistics.median(dt for _, dt in windows) if windows else float("nan"),
        "interval": float(ranks[0]["monitor_interval"]),  # type: ignore[arg-type]
    }


def detection(world: int, root: Path) -> float:
    killed = world // 2 + 1
    out = root / f"kill{world}"
    run = launch(world, out, "--kill", str(killed), "--step", "3")
    named = [r for r in range(world) if r != killed and f"lightning_shardrec: rank {killed}" in run.log(r)]
    if len(named) != world - 1:
        raise RuntimeError(f"{world} ranks: only ranks {named} named rank {killed}")
    return max(run.ended) - float((out / "fault_at").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, nargs="*", default=[8])
    args = parser.parse_args()
    print(f"machine: {_machine()} (shared with other engineers: figures under load)")
    header = (
        "| ranks | launch to 1st step (s) | interpreter / imports / setup / 1st step (s) | step (ms) | "
        "over the 2-rank step (ms) | RSS peak per rank, median / max (MiB) | store ops/s per rank / all | "
        "steady store ops/s per rank (over s) | beat (s) |"
    )
    print(header + "\n|---|---|---|---|---|---|---|---|---|", flush=True)
    base: float | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:  # each row as it is measured (a long run keeps what it has)
            r = measure(world, args.steps, Path(tmp))
            base = r["step"] if base is None else base
            print(
                f"| {world} | {r['to_first']:.1f} | {r['start']:.1f} / {r['imports']:.1f} / {r['setup']:.1f} / "
                f"{r['first']:.1f} | {1e3 * r['step']:.1f} | {1e3 * (r['step'] - base):+.1f} | "
                f"{r['rss_median']:.0f} / {r['rss_max']:.0f} | {r['ops_rank']:.1f} / {r['ops_total']:.0f} | "
                f"{r['ops_steady']:.1f} ({r['steady_s']:.0f}) | {r['interval']:.2f} | (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        for w in args.kill_at:
            seconds = detection(w, Path(tmp))
            print(
                f"detection at {w} ranks: every survivor named the killed rank; all gone {seconds:.1f} s after the kill"
            )
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"finished at load average {load}, {time.strftime('%H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
