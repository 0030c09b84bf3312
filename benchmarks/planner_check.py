"""The planner's Criteo-1TB plans under an independent cost model (``benchmarks/plan_cost.py``, issue 41).

    python benchmarks/planner_check.py [--worlds 64,128,512,1024] [--batch-size 16384] [--write-docs docs/benchmarks.md]

26 Criteo-1TB tables of 128 columns, one id per sample, adagrad, 8 H100-class GPUs per host,
``--batch-size`` samples per rank. Per world size: planning time (CPU s), the plan's slowest rank
and the ratio to the lower bound under ``plan_cost`` (which shares no code with the planner), the
planner's own ratio, max / mean under ``plan_cost``, and the sharding types.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import replace_section  # noqa: E402
from plan_cost import Cluster, Table, evaluate  # noqa: E402
from planner_bench import CRITEO_1TB, criteo_tables  # noqa: E402

from lightning_shardrec.planner import EmbeddingShardingPlanner, ShardingPlan, Topology  # noqa: E402


def criteo_costs() -> dict[str, Table]:
    return {f"t_cat_{i}": Table(rows=n, dim=128) for i, n in enumerate(CRITEO_1TB)}


def plan_criteo(world: int, batch: int, local: int = 8) -> tuple[ShardingPlan, float]:
    topo = Topology(world, compute_device="cuda", local_world_size=local)
    start = time.process_time()
    plan = EmbeddingShardingPlanner(topo, batch_size=batch).plan(criteo_tables())
    return plan, time.process_time() - start


def row(world: int, batch: int) -> str:
    plan, seconds = plan_criteo(world, batch)
    costs = criteo_costs()
    cluster = Cluster(world=world, local=8)
    ev = evaluate(plan, costs, cluster, batch)
    kinds = Counter(ps.sharding_type.value for t in plan.plan.values() for ps in t.values())
    mix = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    own = plan.stats.vs_lower_bound if plan.stats is not None else float("nan")
    return (
        f"| {world} | {seconds:.2f} | {ev.max * 1e3:.3f} | {ev.bound * 1e3:.3f} | **{ev.ratio:.3f}** "
        f"| {own:.3f} | {ev.max / ev.per_rank.mean():.3f} | {mix} |"
    )


SECTION = "## Planner under an independent cost model (issue 41)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="64,128,512,1024")
    parser.add_argument("--batch-size", type=int, default=16384, help="per rank")
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args()
    rows = [row(int(w), args.batch_size) for w in args.worlds.split(",")]
    cmd = ("python benchmarks/planner_check.py " + " ".join(sys.argv[1:])).strip()
    text = "\n".join(
        [
            SECTION,
            "",
            f"Command: `{cmd}`",
            "",
            "| ranks | plan time (CPU s) | slowest rank (ms) | lower bound (ms) | max / bound "
            "| planner's own max / bound | max / mean | sharding types |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    print(text)
    if args.write_docs is not None:
        replace_section(args.write_docs, SECTION, text)


if __name__ == "__main__":
    main()
