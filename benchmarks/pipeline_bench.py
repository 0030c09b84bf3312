"""Pipeline: ``ShardRecStrategy(pipeline=True)`` vs ``pipeline=False`` on 2 CPU ranks (gloo).

    python benchmarks/pipeline_bench.py [--rows 200000,20000] [--batch 1024] [--steps 40]
        [--repeats 3] [--quick] [--write-docs docs/benchmarks.md]

Workload: issue 10's synthetic DLRM shape (8 tables, one feature each: 4 x ``rows[0]``
and 4 x ``rows[1]`` rows, dim 64, sum pooling; power-law ids, mean 8 ids per bag;
13 dense features; bottom MLP 13->128->64, concat with the 8 pooled = 576, top MLP
576->256->1), big tables row-wise and small ones table-wise, so both kinds of input
all-to-all run. Batches are generated before ``fit`` and never timed; one intra-op
thread per rank. Each repeat runs both variants in the same processes, alternating.

Figures per variant: samples/s over the timed steps (after ``--warmup`` steps), the
median of repeats and the spread (min-max). Overlap: the main thread's time blocked
in the input communication per step, ``sync`` = header + id all-to-alls + regroup
without the pipeline, ``exposed`` = the pipeline's waits on the same work;
``hidden / total = 1 - exposed / sync``. ``--write-docs`` replaces only ``## Pipeline``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SECTION = "## Pipeline"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_dlrm import BenchDLRM, StepClock, join_as_rank  # noqa: E402
from harness import replace_section  # noqa: E402


def _identity(x: Any) -> Any:
    return x


class _Clock:
    """Seconds the main thread spends inside the wrapped calls (input communication)."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        setattr(owner, name, timed)


def _instrument() -> _Clock:
    """Time the blocking input-comm calls of both paths (same work: header, all-to-alls, regroup)."""
    from lightning_shardrec.distributed.comm import input_dist
    from lightning_shardrec.distributed.sharded import batch_dist
    from lightning_shardrec.distributed.sharding import piecewise, row_blocks

    clock = _Clock()
    clock.wrap(batch_dist, "exchange_header")  # sync path
    clock.wrap(piecewise, "exchange")
    clock.wrap(row_blocks, "exchange")
    clock.wrap(batch_dist.PrefetchHandle, "progress")  # pipeline: header wait + issuing the all-to-alls
    clock.wrap(input_dist.PendingExchange, "wait")  # pipeline: all-to-all waits + regroup
    return clock


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.data.synthetic import SyntheticRecDataset, SyntheticRecGenerator

    tables, spec = join_as_rank(rank, world, cfg["rows"])
    big = cfg["rows"][0]
    gen = SyntheticRecGenerator(spec)
    steps = cfg["warmup"] + cfg["steps"]
    ds = SyntheticRecDataset(
        spec, batch_size=cfg["batch"], num_batches=steps, rank=rank, world_size=world, generator=gen
    )
    batches = [ds.batch(i) for i in range(steps)]

    clock = _instrument()
    out: dict[str, list[float]] = {}
    for _ in range(cfg["repeats"]):
        for pipeline in (False, True):
            kinds = {f"t_{n}": ["row_wise" if r == big else "table_wise"] for n, r in tables}
            strategy = ShardRecStrategy(
                constraints={t: ParameterConstraints(sharding_types=k) for t, k in kinds.items()},
                embedding_optimizer="rowwise_adagrad",
                pipeline=pipeline,
            )
            marks = StepClock()
            trainer = L.Trainer(
                accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, callbacks=[marks],
            )  # fmt: skip
            loader = DataLoader(batches, batch_size=None, collate_fn=_identity)
            comm0 = clock.total
            trainer.fit(BenchDLRM(tables), train_dataloaders=loader)
            t = marks.marks[cfg["warmup"] :]
            name = "pipeline" if pipeline else "plain"
            out.setdefault(f"{name}_sps", []).append(cfg["batch"] * world * (len(t) - 1) / (t[-1] - t[0]))
            out.setdefault(f"{name}_comm_ms", []).append(1e3 * (clock.total - comm0) / steps)
            if pipeline:
                s = strategy.pipeline.stats
                out.setdefault("hits", []).append(s.hits / max(s.prefetched, 1))
    return out


def report(results: list[dict[str, list[float]]], cfg: dict[str, Any], command: str) -> str:
    def med(key: str) -> tuple[float, float, float]:
        per_repeat = [statistics.mean(r[key][i] for r in results) for i in range(cfg["repeats"])]
        return statistics.median(per_repeat), min(per_repeat), max(per_repeat)

    plain, piped = med("plain_sps"), med("pipeline_sps")
    sync, exposed = med("plain_comm_ms"), med("pipeline_comm_ms")
    hidden = 1 - exposed[0] / sync[0] if sync[0] > 0 else float("nan")
    big, small = cfg["rows"]
    lines = [
        SECTION,
        "",
        f"`{command}` — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{datetime.date.today().isoformat()}, 2 ranks (gloo, CPU, 1 thread each).",
        "",
        f"Workload: 4 x {big:,} + 4 x {small:,} rows, dim 64 (big tables row-wise, small table-wise), "
        f"batch {cfg['batch']} per rank, {cfg['steps']} timed steps after {cfg['warmup']} warm-up, "
        f"median of {cfg['repeats']} repeats (min-max).",
        "",
        "| variant | samples/s | input comm blocking the step, ms/step |",
        "|---|---|---|",
        f"| `pipeline=False` | {plain[0]:,.0f} ({plain[1]:,.0f}-{plain[2]:,.0f}) "
        f"| {sync[0]:.2f} ({sync[1]:.2f}-{sync[2]:.2f}) |",
        f"| `pipeline=True` | {piped[0]:,.0f} ({piped[1]:,.0f}-{piped[2]:,.0f}) "
        f"| {exposed[0]:.2f} ({exposed[1]:.2f}-{exposed[2]:.2f}) |",
        "",
        f"Speed-up {piped[0] / plain[0]:.3f}x. Overlap (input comm hidden / total input comm): "
        f"{100 * hidden:.0f}%. Prefetched batches used by their forward: "
        f"{100 * statistics.mean(h for r in results for h in r['hits']):.0f}%.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace (or append) this script's section of ``docs/benchmarks.md``; keep a ``Reading:``."""
    replace_section(path, SECTION, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="200000,20000", help="rows of the 4 big and the 4 small tables")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--write-docs", type=Path, default=None)
    a = p.parse_args()
    cfg = {
        "rows": [int(x) for x in a.rows.split(",")],
        "batch": a.batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "repeats": a.repeats,
    }
    if a.quick:
        cfg.update(rows=[2000, 200], batch=64, steps=4, warmup=1, repeats=1)
    from lightning_shardrec.testing import run_ranks

    results = run_ranks(run_rank, 2, cfg, timeout=1800)
    command = "python benchmarks/pipeline_bench.py " + " ".join(sys.argv[1:])
    text = report(results, cfg, command.strip())
    print(text)
    if a.write_docs is not None:
        write_section(a.write_docs, text)


if __name__ == "__main__":
    main()
