"""Dynamic tables vs static tables of the same capacity, on the e2e workload (issue 20, item 6).

    python benchmarks/dynamic_bench.py [--rounds 3] [--warmup 20] [--steps 40]
        [--variants ebc_static,ebc_dynamic,dmp1_static,dmp1_dynamic,dmp2_static,dmp2_dynamic]
        [--quick] [--write-docs docs/benchmarks.md]

Workload: the benchmark DLRM of ``e2e_bench.py`` (8 tables, 4 x 200,000 + 4 x 20,000
rows, dim 64, ~8 zipf ids per bag, batch 1024 per rank; MLPs 13-128-64 and 576-256-1;
BCE). The batches are ``e2e_bench.py``'s; a *static* variant reads them as they are (ids
in ``[0, rows)``), a *dynamic* one reads every id ``v`` of table ``t`` as the raw 64-bit
id ``v * 0x9E3779B97F4A7C15 + t`` (a bijection: the same distribution, spread over all
of int64) in a table of the same capacity with ``dynamic=DynamicConfig()`` (LRU, 16
slots per bucket, every id admitted at once). So a dynamic step does everything a static
one does plus the id -> slot mapping, the fresh rows of admitted ids and their
optimizer-state resets.

Variants (fresh processes, one intra-op thread per rank):

- ``ebc_static`` / ``ebc_dynamic``: the unsharded ``EmbeddingBagCollection`` + MLPs, one
  process, ``torch.optim.Adagrad`` (lr 0.05) on everything (dense gradients for the tables:
  the plain module's path); the dynamic one resets Adagrad rows through
  ``optimizer_reset_hook``.
- ``dmp1_static`` / ``dmp1_dynamic``: ``DistributedModelParallel`` in one process (world
  size 1), fused row-wise Adagrad tables (lr 0.05, eps 1e-8; ``kernel="auto"``), Adagrad MLPs.
- ``dmp2_static`` / ``dmp2_dynamic``: the same on 2 ranks (gloo), batch 1024 per rank.

The step is start of one iteration to the start of the next; the first ``--warmup``
steps are not timed (the dynamic tables fill in them: see the admissions per timed step in
the table). Ratios are paired per round (dynamic / static of the same kind, whole timed run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _e2e_common import (  # noqa: E402
    DIM,
    EPS,
    LR,
    RankResult,
    StepTimer,
    load_batches,
    make_dense_arch,
    peak_rss_mib,
    read_result,
    rss_mib,
    table_rows,
    worker_env,
)
from e2e_bench import _clean_env, machine, make_batch_files  # noqa: E402
from harness import Stat, machine_heading, replace_machine_section  # noqa: E402

SECTION = "## Dynamic tables"
VARIANTS = ["ebc_static", "ebc_dynamic", "dmp1_static", "dmp1_dynamic", "dmp2_static", "dmp2_dynamic"]
RAW_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so v -> v * M + t is a bijection


def world_of(variant: str) -> int:
    return 2 if variant.startswith("dmp2") else 1


# ===============================================================================================
# Workers
# ===============================================================================================


def tables(shrink: int, dynamic: bool) -> list[Any]:
    from lightning_shardrec import DynamicConfig, EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            num_embeddings=n,
            embedding_dim=DIM,
            name=f"t{i}",
            feature_names=[f"f{i}"],
            dynamic=DynamicConfig() if dynamic else None,
        )
        for i, n in enumerate(table_rows(shrink))
    ]


def raw_ids(values: Any, lengths: Any, batch_size: int) -> Any:
    """Feature-major ids -> raw 64-bit ids ``v * M + t`` of their table ``t`` (int64 wraparound)."""
    import torch

    per_feature = lengths.view(-1, batch_size).sum(1)
    table = torch.repeat_interleave(torch.arange(per_feature.numel()), per_feature)
    return values * RAW_MULT + table


def batches_of(path: Path, steps: int, dynamic: bool) -> list[tuple[Any, Any, Any]]:
    from lightning_shardrec import KeyedJaggedTensor

    out = []
    for b in load_batches(path)[:steps]:
        n = b["dense"].shape[0]
        values = raw_ids(b["values"], b["lengths"], n) if dynamic else b["values"]
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(8)], values, lengths=b["lengths"], stride=n)
        out.append((b["dense"], kjt, b["labels"]))
    return out


def dynamic_totals(model: Any) -> dict[str, int]:
    """Summed stats of every ``DynamicIdMapper`` in ``model`` (this rank's buckets)."""
    from lightning_shardrec.modules import DynamicIdMapper

    total: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, DynamicIdMapper):
            for k, v in m.stats().items():
                total[k] = total.get(k, 0) + v
    return total


def run_loop(batches: list[Any], model: Any, opts: list[Any], warmup: int) -> tuple[list[float], list[float], str]:
    """The timed plain loop (``train_timed`` plus dynamic stats around the timed part)."""
    import torch.nn.functional as F

    timer, losses, before = StepTimer(warmup), [], {}
    for i, (dense, kjt, labels) in enumerate(batches):
        if i == warmup:
            before = dynamic_totals(model)
        timer.tick()
        for o in opts:
            o.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
    timer.tick()
    after = dynamic_totals(model)
    note = ""
    if after:
        timed = len(batches) - warmup
        per = (after["admissions"] - before.get("admissions", 0)) / timed
        note = (
            f"{per:,.0f} admissions/step timed; occupancy {after['occupancy']:,} of {after['capacity']:,}; "
            f"evictions {after['evictions']:,}"
        )
    return timer.seconds, losses, note


def _model(shrink: int, dynamic: bool, device: str) -> Any:
    import torch
    from torch import nn

    from lightning_shardrec import EmbeddingBagCollection

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables(shrink, dynamic), device=device)
            self.dense_arch = make_dense_arch()

        def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
            return self.dense_arch(dense, self.ebc(kjt).values())

    return Model()


def worker_ebc(variant: str, a: argparse.Namespace) -> None:
    import torch

    from lightning_shardrec.modules import optimizer_reset_hook

    import_rss = rss_mib()
    worker_env()
    dynamic = variant.endswith("dynamic")
    batches = batches_of(a.data / "rank0.pt", a.warmup + a.steps, dynamic)
    model = _model(a.shrink, dynamic, "cpu")
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    model.ebc.register_reset_hook(optimizer_reset_hook(opt))
    seconds, losses, note = run_loop(batches, model, [opt], a.warmup)
    bsz = int(batches[0][0].shape[0])
    RankResult(variant, 0, 1, bsz, seconds, import_rss, peak_rss_mib(), losses, "unsharded", note).write(a.out)


def worker_dmp(variant: str, a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_shardrec import DistributedModelParallel, FusedOptimConfig

    import_rss = rss_mib()
    rank, world = worker_env()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dynamic = variant.endswith("dynamic")
    batches = batches_of(a.data / f"rank{rank}.pt", a.warmup + a.steps, dynamic)
    bsz = int(batches[0][0].shape[0])
    config = FusedOptimConfig(optimizer="rowwise_adagrad", lr=LR, eps=EPS)
    model = DistributedModelParallel(_model(a.shrink, dynamic, "meta"), embedding_optimizer=config, batch_size=bsz)
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=LR)
    seconds, losses, note = run_loop(batches, model, [opt], a.warmup)
    kinds: dict[str, list[str]] = {}
    for per_table in model.plan.plan.values():
        for name, ps in per_table.items():
            kinds.setdefault(ps.sharding_type.value, []).append(name)
    plan = "; ".join(f"{k}: {','.join(sorted(v))}" for k, v in sorted(kinds.items()))
    RankResult(variant, rank, world, bsz, seconds, import_rss, peak_rss_mib(), losses, plan, note).write(a.out)
    dist.destroy_process_group()


# ===============================================================================================
# Orchestrator
# ===============================================================================================


def run_variant(variant: str, a: argparse.Namespace, data: Path, out: Path) -> str:
    """Run one variant to completion; '' on success, else the reason (tail of its output)."""
    import subprocess

    for old in out.glob(f"{variant}.rank*.json"):
        old.unlink()
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--data", str(data), "--out", str(out),
        "--warmup", str(a.warmup), "--steps", str(a.steps), "--shrink", str(a.shrink),
    ]  # fmt: skip
    env, world = _clean_env(), world_of(variant)
    procs = []
    for r in range(world):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world))
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent), log))
    failed = ""
    deadline = time.monotonic() + a.timeout
    for p, log in procs:
        try:
            rc: int | None = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0 and not failed:
            log.seek(0)
            lines = [ln for ln in log.read().strip().splitlines() if ln.strip()]
            failed = f"exit {rc if rc is not None else 'timeout'}: {lines[-1] if lines else ''}"[:300]
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    if not failed and len(list(out.glob(f"{variant}.rank*.json"))) != world:
        failed = "finished without writing every rank's result"
    return failed


def whole(results: list[dict[str, Any]]) -> float:
    """Mean seconds per step of the whole timed run (the slowest rank)."""
    n = min(len(r["step_seconds"]) for r in results)
    return max(sum(r["step_seconds"][:n]) for r in results) / n


def report(a: argparse.Namespace, runs: dict[str, list[list[dict[str, Any]]]], failures: dict[str, str]) -> str:
    cmd = "python benchmarks/dynamic_bench.py " + " ".join(a.argv)
    lines = [
        f"Command: `{cmd.strip()}`  ",
        f"Machine: {machine()}; {os.cpu_count()} cores, one intra-op thread per rank. "
        f"Date: {datetime.date.today().isoformat()}. Load average (1 min) at start / end: "
        f"{a.load_start:.1f} / {os.getloadavg()[0]:.1f}.  ",
        "Workload: the e2e benchmark DLRM (8 tables, 4 x 200,000 + 4 x 20,000 rows, dim 64, ~8 zipf ids per bag, "
        f"batch {a.batch_size} per rank){' (tables 1/' + str(a.shrink) + ' the rows: --quick)' if a.shrink > 1 else ''}"
        "; dynamic variants: the same tables with `dynamic=DynamicConfig()` (same capacity, LRU, 16 slots per "
        "bucket) fed the same ids as raw 64-bit values. "
        f"{a.warmup} untimed + {a.steps} timed steps per run, {a.rounds} rounds (every variant once per round, "
        "shuffled order, fresh processes); ms/step = median over all timed steps of all rounds (slowest rank), "
        "spread = min..max of the rounds' mean step.",
        "",
        "| variant | ranks | ms/step (median) | spread (round means) | samples/s | peak RSS (MiB) | final loss "
        "| plan | dynamic tables (rank 0) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for v in VARIANTS:
        if v in failures:
            lines.append(f"| {v} | {world_of(v)} | - | - | - | - | - | not run: {failures[v]} | |")
            continue
        if not runs.get(v):
            continue
        steps = [max(x) for rr in runs[v] for x in zip(*(r["step_seconds"] for r in rr), strict=False)]
        ms = statistics.median(steps) * 1e3
        means = Stat([whole(rr) * 1e3 for rr in runs[v]])
        last = sorted(runs[v][-1], key=lambda r: r["rank"])
        sps = sum(r["batch_size"] for r in last) / (ms / 1e3)
        loss = statistics.mean(last[0]["losses"][-10:])
        peak = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in last)
        lines.append(
            f"| {v} | {world_of(v)} | {ms:.1f} | {means.lo:.1f}..{means.hi:.1f} | {sps:,.0f} | {peak} | {loss:.4f} "
            f"| {last[0]['plan']} | {last[0]['note'] or '-'} |"
        )
    lines += ["", "Dynamic / static step time, paired per round (target <= 1.4):", ""]
    for kind in ("ebc", "dmp1", "dmp2"):
        s, d = runs.get(f"{kind}_static"), runs.get(f"{kind}_dynamic")
        if s and d:
            r = Stat([whole(x) / whole(y) for x, y in zip(d, s, strict=True)])
            lines.append(f"- {kind}_dynamic / {kind}_static = {r.median:.2f} (rounds {r.lo:.2f}..{r.hi:.2f})")
        elif f"{kind}_static" in VARIANTS and (kind + "_static" in runs or kind + "_dynamic" in runs):
            lines.append(f"- {kind}_dynamic / {kind}_static = - (a variant did not run)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--shrink", type=int, default=1, help="divide table rows by this (tests)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per variant run")
    p.add_argument("--write-docs", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tables 1/100, batch 128, 1 round of 2+4 steps")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.worker is not None:
        (worker_ebc if a.worker.startswith("ebc") else worker_dmp)(a.worker, a)
        return
    if a.quick:
        a.rounds, a.warmup, a.steps, a.batch_size, a.shrink = 1, 2, 4, 128, 100
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; available: {', '.join(VARIANTS)}")
    a.load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="dynamic_bench_"))
    data, out = work / "data", work / "out"
    data.mkdir()
    out.mkdir()
    make_batch_files(data, a.warmup + a.steps, a.batch_size, a.shrink)
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    failures: dict[str, str] = {}
    order = list(variants)
    for rnd in range(a.rounds):
        random.Random(rnd).shuffle(order)
        for v in order:
            if v in failures:
                continue
            t = time.perf_counter()
            failed = run_variant(v, a, data, out)
            if failed:
                failures[v] = failed
                print(f"dynamic_bench: {v} failed: {failed}", file=sys.stderr)
                continue
            runs[v].append([read_result(f) for f in sorted(out.glob(f"{v}.rank*.json"))])
            print(f"dynamic_bench: round {rnd} {v} {time.perf_counter() - t:.1f} s", file=sys.stderr)
    text = report(a, runs, failures)
    print(text)
    if a.write_docs is not None:
        replace_machine_section(a.write_docs, SECTION, machine_heading(), text)


if __name__ == "__main__":
    main()
