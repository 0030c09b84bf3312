"""Plain-module recommender (``examples/existing_model``) under DDP vs shardrec: memory per rank and speed.

Runs the example's ``Retrieval`` model, unchanged, with ``--strategy ddp`` and
``--strategy shardrec`` (2 processes each), alternating, ``--rounds`` times, and reports
per-rank embedding MiB, per-rank peak RSS and steps/s (median, min..max).

    python benchmarks/existing_model_bench.py --rounds 3 --write-docs docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from harness import Stat, machine_heading, replace_section

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Existing models: plain nn.Embedding under DDP vs shardrec"
LINE = re.compile(r"rank (\d+): embedding_mib=([\d.]+), peak_rss_mib=([\d.]+), steps_per_s=([\d.]+)")


def run(strategy: str, steps: int) -> dict[int, tuple[float, float, float]]:
    cmd = [
        sys.executable,
        str(ROOT / "examples/existing_model/train.py"),
        "--strategy",
        strategy,
        "--steps",
        str(steps),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return {int(m[1]): (float(m[2]), float(m[3]), float(m[4])) for m in LINE.finditer(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args()
    figures: dict[str, list[dict[int, tuple[float, float, float]]]] = {"ddp": [], "shardrec": []}
    for _ in range(args.rounds):
        for strategy in figures:
            figures[strategy].append(run(strategy, args.steps))
    rows = []
    for strategy, runs in figures.items():
        emb = [f"{runs[0][r][0]:.1f}" for r in sorted(runs[0])]
        rss = [f"{Stat([run[r][1] for run in runs]).median:.0f}" for r in sorted(runs[0])]
        speed = Stat([run[0][2] for run in runs])
        steps = f"{speed.median:.2f} ({speed.lo:.2f}..{speed.hi:.2f})"
        rows.append(f"| {strategy} | {' / '.join(emb)} | {' / '.join(rss)} | {steps} |")
    text = (
        f"{HEADING}\n\n"
        f"`examples/existing_model/train.py` (three plain tables, 200k/100k/100k x 32, Adagrad, global batch 1024), "
        f"2 CPU processes, {args.rounds} alternating rounds of {args.steps} steps; CPU: {machine_heading()}.\n"
        f"Command: `python benchmarks/existing_model_bench.py --rounds {args.rounds} "
        "--write-docs docs/benchmarks.md`.\n\n"
        "| strategy | embedding MiB per rank (r0 / r1) | peak RSS MiB per rank | steps/s, median (min..max) |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if args.write_docs is not None:
        replace_section(args.write_docs, HEADING, text)


if __name__ == "__main__":
    main()
