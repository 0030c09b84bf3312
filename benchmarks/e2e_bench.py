"""End-to-end training throughput, side by side with the peers, in one run (issue 10).

    python benchmarks/e2e_bench.py [--rounds 3] [--warmup 10] [--steps 60] [--window 10]
        [--variants shardrec,dmp_plain,torchrec_dmp,ddp_sparse,kernel_floor,kernel_floor_torch]
        [--quick] [--no-profile] [--plot docs/e2e_throughput.png]
        [--write-docs docs/benchmarks.md]

Workload (issue 10, kept exactly so figures compare across versions): 8 tables
(4 x 200,000 + 4 x 20,000 rows, dim 64, fp32, sum pooling), one power-law feature
each, ~8 ids per bag; 13 dense features; bottom MLP 13->128->64, concat interaction
(576 wide), top MLP 576->256->1, BCE-with-logits. Tables: fused row-wise Adagrad
(lr 0.05, eps 1e-8); dense layers: Adagrad (lr 0.05). Batch 1024 per rank.

Variants (each in fresh processes; one intra-op thread per rank):

- ``shardrec``: ``Trainer(strategy=ShardRecStrategy(comm_transport="auto", pipeline=False, ...), accelerator="cpu",
  devices=2)`` (the all-to-alls through same-host shared memory), the full Lightning loop (its
  own popen launcher), steps timed inside the loop by a callback (start of a batch to start
  of the next), process start and warm-up excluded.
- ``shardrec_pipeline``: the same run with ``ShardRecStrategy(pipeline=True)``.
- ``shardrec_bf16``: the same run with ``ShardRecStrategy(comm_precision="bf16")`` (pooled
  outputs and their gradients cross ranks in bf16).
- ``shardrec_pg_pipeline``: ``shardrec_pg`` with ``pipeline=True``: **the defaults** (the process group since
  issue 30, the pipeline on 2+ ranks since issue 42).
- ``shardrec_pg``: the same run with ``ShardRecStrategy(comm_transport="pg")`` (the all-to-alls on gloo's
  loopback TCP instead of same-host shared memory), the pipeline off as in every ``shardrec*`` variant
  without ``_pipeline`` in its name.
- ``dmp_plain``: our ``DistributedModelParallel`` in a plain loop, 2 ranks (gloo).
- ``torchrec_dmp``: TorchRec 1.8.0's ``DistributedModelParallel``, its default planner,
  2 ranks (gloo), run by ``benchmarks/.venv-torchrec/bin/python`` (made by
  ``benchmarks/setup_torchrec_venv.sh``); skipped when that venv is absent.
- ``ddp_sparse``: 8 ``nn.EmbeddingBag(sparse=True)`` + MLPs in DDP, 2 ranks; Adagrad on
  everything (element-wise on the tables: torch has no row-wise Adagrad).
- ``kernel_floor``: one fbgemm TBE holding all 8 tables (exact row-wise Adagrad) + the
  MLPs, one process, one core, no framework. Two ranks on two cores reach 2x at best.
- ``kernel_floor_torch``: the same job on our portable torch kernel.
- The report's **floor** is the faster of the two per round (named beside it): the
  fastest one-core job this machine runs, whichever kernel that is (``kernel="auto"``
  times both and keeps the faster, so it is also the kernel the ``shardrec`` variants run).

Batches are generated once by this process (``SyntheticRecGenerator``, seed 0), saved
as plain tensors, and every variant trains on the same ones (rank ``r`` of 2 takes rows
``[r * 1024, (r + 1) * 1024)`` of each global batch; ``kernel_floor`` takes rank 0's),
built into the variant's input type before its loop. Each round runs every variant
once, in a shuffled order; samples/s is measured per window of ``--window`` steps
(global batch x steps / the slowest rank's seconds); the table gives the median over
all windows of all rounds and the spread (min..max). Ratios are paired per round
(median, min..max). Peak RSS is ``ru_maxrss`` per rank at the end; "import" is the RSS
right after the variant's imports, before any model or data. CPU ms/step is each rank's
on-CPU time per timed step (``/proc/self/task/*/schedstat``, median over rounds): its main
thread + its other threads (gloo's, Lightning's). Waiting (for the peer, for a core) costs
wall time but no CPU, so under other jobs' load it moves less than the wall time, though it
still grows (cache contention, a virtual machine's stolen time): compare variants of one run.
On an idle machine, 2 ranks' sum against 2 x the step's wall is how busy the two cores were.

The variants that run this project's code are in ``_e2e_workers.py``; this file generates
the batches, runs every variant, and reports.

``--write-docs`` replaces only this machine's part (``### <CPU model> (<ISA>)``) of the
``## End-to-end training`` section, keeping other machines' figures and a hand-written
``Reading:`` paragraph at its end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _e2e_common import read_result, table_rows  # noqa: E402
from _e2e_workers import WORKERS, WorkerArgs  # noqa: E402
from harness import Stat, free_port, machine, machine_heading, replace_machine_section  # noqa: E402

SECTION = "## End-to-end training"
VARIANTS = [
    "shardrec", "shardrec_pipeline", "shardrec_bf16", "shardrec_pg", "shardrec_pg_pipeline", "dmp_plain",
    "torchrec_dmp", "ddp_sparse", "kernel_floor", "kernel_floor_torch",
]  # fmt: skip
WORLD = {
    "shardrec": 2, "shardrec_pipeline": 2, "shardrec_bf16": 2, "shardrec_pg": 2, "shardrec_pg_pipeline": 2,
    "dmp_plain": 2, "torchrec_dmp": 2,
    "ddp_sparse": 2, "kernel_floor": 1, "kernel_floor_torch": 1,
}  # fmt: skip
TORCHREC_VENV = HERE / ".venv-torchrec"
TORCHREC_WORKER = HERE / "_e2e_torchrec_worker.py"


# ===============================================================================================
# Orchestrator
# ===============================================================================================


def make_batch_files(out: Path, steps: int, batch_size: int, shrink: int) -> None:
    import torch

    from lightning_shardrec.data.synthetic import FeatureSpec, SyntheticRecGenerator, SyntheticSpec

    features = tuple(FeatureSpec(name=f"f{i}", num_embeddings=n) for i, n in enumerate(table_rows(shrink)))
    gen = SyntheticRecGenerator(SyntheticSpec(features=features, num_dense=13, seed=0))
    g = 2 * batch_size
    for rank in range(2):
        rows = (rank * batch_size, (rank + 1) * batch_size)
        items = []
        for i in range(steps):
            b = gen.global_batch(i, g, rows=rows)
            items.append(
                {
                    "dense": b.dense.contiguous(),
                    "labels": b.labels.contiguous(),
                    "values": b.sparse.values().long().contiguous(),
                    "lengths": b.sparse.lengths().long().contiguous(),
                }
            )
        torch.save(items, out / f"rank{rank}.pt")


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_variant(variant: str, a: argparse.Namespace, data: Path, out: Path, profile: Path | None = None) -> str:
    """Run one variant to completion; '' on success, else the reason (tail of its stderr)."""
    for old in out.glob(f"{variant}.rank*.json"):
        old.unlink()
    common = [
        "--worker", variant, "--data", str(data), "--out", str(out),
        "--warmup", str(a.warmup), "--steps", str(a.steps), "--shrink", str(a.shrink),
        "--batch-size", str(a.batch_size),
    ]  # fmt: skip
    if profile is not None:
        common += ["--profile", str(profile)]
    env = _clean_env()
    if variant == "torchrec_dmp":
        python = TORCHREC_VENV / "bin" / "python"
        cmds = [[str(python), str(TORCHREC_WORKER), *common] for _ in range(2)]
    elif variant.startswith("shardrec"):
        cmds = [[sys.executable, str(Path(__file__).resolve()), *common]]  # Lightning starts rank 1
    else:
        cmds = [[sys.executable, str(Path(__file__).resolve()), *common] for _ in range(WORLD[variant])]
    procs = []
    logs = []
    for r, cmd in enumerate(cmds):
        e = dict(env)
        if len(cmds) > 1:
            e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(len(cmds)))
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed below, after the wait
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent))
    deadline = time.monotonic() + a.timeout
    failed = ""
    for p, log in zip(procs, logs, strict=True):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0 and not failed:
            log.seek(0)
            tail = log.read()[-3000:]
            failed = f"exit {rc if rc is not None else 'timeout'}: {tail}"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    if not failed and len(list(out.glob(f"{variant}.rank*.json"))) != WORLD[variant]:
        failed = "finished without writing every rank's result"
    return failed


def windows(results: list[dict[str, Any]], window: int) -> list[float]:
    """Samples/s per window of ``window`` steps: global batch x steps / slowest rank's time."""
    n = min(len(r["step_seconds"]) for r in results)
    global_batch = sum(r["batch_size"] for r in results)
    out = []
    for lo in range(0, n - window + 1, window):
        sec = max(sum(r["step_seconds"][lo : lo + window]) for r in results)
        out.append(global_batch * window / sec)
    return out


def whole(results: list[dict[str, Any]]) -> float:
    n = min(len(r["step_seconds"]) for r in results)
    global_batch = sum(r["batch_size"] for r in results)
    return global_batch * n / max(sum(r["step_seconds"][:n]) for r in results)


def cpu_per_rank(rounds: list[list[dict[str, Any]]]) -> str:
    """``main+others`` CPU ms per timed step, per rank (median over rounds): ``21.5+3.8 / 21.9+3.5``."""
    by_rank: dict[int, list[dict[str, float]]] = {}
    for rr in rounds:
        for r in rr:
            if r.get("cpu_ms"):
                by_rank.setdefault(r["rank"], []).append(r["cpu_ms"])
    if not by_rank:
        return "-"
    parts = []
    for _, cpus in sorted(by_rank.items()):
        main = statistics.median(c.get("main", 0.0) for c in cpus)
        other = statistics.median(c.get("other threads", 0.0) for c in cpus)
        parts.append(f"{main:.1f}+{other:.1f}")
    return " / ".join(parts)


def report(
    a: argparse.Namespace,
    runs: dict[str, list[list[dict[str, Any]]]],
    failures: dict[str, str],
    profile: dict[str, Any] | None,
    cmd: str,
    plot: Path | None,
) -> str:
    per_window = {v: Stat([x for rr in rounds for x in windows(rr, a.window)]) for v, rounds in runs.items() if rounds}
    per_round = {v: [whole(rr) for rr in rounds] for v, rounds in runs.items()}
    # the floor: the faster one-core kernel job on this machine, whichever kernel that is
    floors = [v for v in ("kernel_floor", "kernel_floor_torch") if v in per_window]
    floor_name = max(floors, key=lambda v: per_window[v].median) if floors else None
    floor = per_window[floor_name] if floor_name else None
    if floors:
        per_round["floor"] = [max(x) for x in zip(*(per_round[v] for v in floors), strict=True)]
    fastest = {"kernel_floor": "fbgemm", "kernel_floor_torch": "torch"}.get(floor_name or "", "-")
    lines = [
        SECTION,
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}; {os.cpu_count()} cores, one intra-op thread per rank. "
        f"Date: {datetime.date.today().isoformat()}. Load average (1 min) at start / end: "
        f"{a.load_start:.1f} / {os.getloadavg()[0]:.1f}.  ",
        f"Workload: the benchmark DLRM (8 tables, 4 x 200,000 + 4 x 20,000 rows, dim 64, ~8 ids per bag; "
        f"13 dense features; MLPs 13-128-64 and 576-256-1; row-wise Adagrad tables, Adagrad dense)"
        f"{' (tables 1/' + str(a.shrink) + ' the rows: --quick)' if a.shrink > 1 else ''}; "
        f"batch {a.batch_size} per rank, {a.warmup} warm-up + {a.steps} timed steps per run, {a.rounds} rounds "
        f"(every variant once per round, shuffled order, fresh processes). samples/s per window of {a.window} steps "
        "= global batch x steps / slowest rank's seconds; median over all windows of all rounds, spread = min..max. "
        "Step = start of one iteration to the start of the next (data fetch, logging, optimizer included).",
        "",
        f"Floor = the faster one-core kernel job here: {floor_name} ({fastest} kernel).",
        "",
        "| variant | ranks | samples/s (median) | spread | ms/step (median) | x floor "
        "| CPU ms/step per rank (main + other threads) | peak RSS per rank (MiB) | import RSS (MiB) "
        "| final loss | plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in VARIANTS:
        if v in failures:
            lines.append(f"| {v} | {WORLD[v]} | - | - | - | - | - | - | - | - | not run: {failures[v]} |")
            continue
        if v not in per_window:
            continue
        st = per_window[v]
        last = runs[v][-1]
        ms = statistics.median([s for rr in runs[v] for s in rr[0]["step_seconds"]]) * 1e3
        peak = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in sorted(last, key=lambda r: r["rank"]))
        imp = " / ".join(f"{r['import_rss_mib']:.0f}" for r in sorted(last, key=lambda r: r["rank"]))
        loss = statistics.mean(last[0]["losses"][-a.window :])
        vs = f"{st.median / floor.median:.2f}" if floor else "-"
        plan = last[0].get("plan", "")
        lines.append(
            f"| {v} | {WORLD[v]} | {st.median:,.0f} | {st.lo:,.0f}..{st.hi:,.0f} | {ms:.1f} | {vs} "
            f"| {cpu_per_rank(runs[v])} | {peak} | {imp} | {loss:.4f} | {plan} |"
        )

    def ratio(num: str, den: str) -> str:
        if not per_round.get(num) or not per_round.get(den):
            return "- (a variant did not run)"
        rs = Stat([x / y for x, y in zip(per_round[num], per_round[den], strict=True)])
        return f"{rs.median:.2f} (rounds {rs.lo:.2f}..{rs.hi:.2f})"

    lines += [
        "",
        "Ratios, paired per round (each round's whole timed run of the two variants):",
        "",
        f"- shardrec / torchrec_dmp = {ratio('shardrec', 'torchrec_dmp')} (vs TorchRec 1.8's DMP)",
        f"- shardrec_bf16 / torchrec_dmp = {ratio('shardrec_bf16', 'torchrec_dmp')} (bf16 pooled-output comms)",
        f"- shardrec_bf16 / shardrec = {ratio('shardrec_bf16', 'shardrec')}",
        f"- shardrec / shardrec_pg = {ratio('shardrec', 'shardrec_pg')} (shared-memory all-to-alls vs gloo's TCP)",
        f"- shardrec_pg / torchrec_dmp = {ratio('shardrec_pg', 'torchrec_dmp')}",
        f"- shardrec_pg_pipeline / torchrec_dmp = {ratio('shardrec_pg_pipeline', 'torchrec_dmp')} "
        "(the defaults: the process group, the pipeline on)",
        f"- shardrec_pg_pipeline / floor ({fastest}) = {ratio('shardrec_pg_pipeline', 'floor')}",
        f"- shardrec / floor ({fastest}) = {ratio('shardrec', 'floor')} (2.0 = two cores' ideal)",
        f"- shardrec / dmp_plain = {ratio('shardrec', 'dmp_plain')} (1.0 = no Lightning overhead)",
        f"- dmp_plain / torchrec_dmp = {ratio('dmp_plain', 'torchrec_dmp')}",
        f"- ddp_sparse / floor = {ratio('ddp_sparse', 'floor')}",
        f"- kernel_floor_torch / kernel_floor = {ratio('kernel_floor_torch', 'kernel_floor')} "
        "(our portable kernel vs fbgemm's CPU TBE, same one-core job)",
        "",
        same_losses(runs),
        "",
    ]
    if plot is not None:
        base = a.write_docs.parent if a.write_docs else Path(".")
        lines += [f"![samples/s per variant]({os.path.relpath(plot, base)})", ""]
    if profile is not None:
        lines += profile_lines(profile)
    return "\n".join(lines)


#: variants running this project's code in fp32 on 2 ranks: from the same seed, the same losses at every step
OURS_FP32 = ("dmp_plain", "shardrec", "shardrec_pipeline", "shardrec_pg", "shardrec_pg_pipeline")


def same_losses(runs: dict[str, list[list[dict[str, Any]]]]) -> str:
    """Each of our fp32 variants' per-step losses (every rank, last round) against ``dmp_plain``'s: the
    largest difference (the kernels ``kernel="auto"`` picks per run may round differently; 0 = bit for bit)."""
    if not runs.get("dmp_plain"):
        return "Losses: dmp_plain did not run, nothing to compare."

    def losses(v: str) -> list[float]:
        return [x for r in sorted(runs[v][-1], key=lambda r: r["rank"]) for x in r["losses"]]

    ref = losses("dmp_plain")
    diffs = [
        f"{v} {max(abs(x - y) for x, y in zip(losses(v), ref, strict=True)):.1e}"
        for v in OURS_FP32
        if v != "dmp_plain" and runs.get(v) and len(losses(v)) == len(ref)
    ]
    return "Losses at every step (every rank, same seed) against dmp_plain, largest difference: " + (
        ", ".join(diffs) or "no other variant of ours ran"
    )


def profile_lines(p: dict[str, Any]) -> list[str]:
    walls = p["all_wall_ms"]
    out = [
        f"Profile (a separate shardrec run after the rounds, rank 0, one torch.profiler session per timed step, "
        f"{len(walls)} steps; wall inside the profiler: median {statistics.median(walls):.1f} ms, slowest "
        f"{max(walls):.1f} ms; the profiler slows steps, so compare shares, not absolute ms with the table). "
        "Self CPU time by kind of op, slowest and median step (ms); the rest of the wall time is Python outside "
        "any profiled scope (Lightning's loop, hooks, logging, our sharded modules' Python):",
        "",
        "| kind of op (self time) | slowest step (ms) | median step (ms) |",
        "|---|---:|---:|",
    ]
    slow, med = p["slowest"], p["median"]
    keys = sorted(set(slow["top_ms"]) | set(med["top_ms"]), key=lambda k: -slow["top_ms"].get(k, 0.0))
    for k in keys:
        s, m = slow["top_ms"].get(k, 0.0), med["top_ms"].get(k, 0.0)
        if max(s, m) >= 0.2:
            out.append(f"| {k} | {s:.1f} | {m:.1f} |")
    out.append(
        f"| (python outside ops) | {slow['wall_ms'] - sum(slow['top_ms'].values()):.1f} "
        f"| {med['wall_ms'] - sum(med['top_ms'].values()):.1f} |"
    )
    out.append(f"| **step wall** | {slow['wall_ms']:.1f} | {med['wall_ms']:.1f} |")
    out.append("")
    return out


def make_plot(path: Path, a: argparse.Namespace, runs: dict[str, list[list[dict[str, Any]]]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("e2e_bench: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    names = [v for v in VARIANTS if runs.get(v)]
    stats = [Stat([x for rr in runs[v] for x in windows(rr, a.window)]) for v in names]
    med = [s.median for s in stats]
    err = [[s.median - s.lo for s in stats], [s.hi - s.median for s in stats]]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    colors = ["tab:blue" if v.startswith("shardrec") else "tab:gray" for v in names]
    ax.bar(names, med, yerr=err, capsize=4, color=colors)
    floors = [v for v in ("kernel_floor", "kernel_floor_torch") if v in names]
    if floors:
        best = max(floors, key=lambda v: med[names.index(v)])
        f = med[names.index(best)]
        ax.axhline(2 * f, ls="--", c="k", lw=1, label=f"2 x {best} (the faster floor; two cores' ideal)")
        ax.legend(loc="upper right", fontsize=8)
    for i, m in enumerate(med):
        ax.text(i, m, f"{m:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples/s (median over windows; bars: min..max)")
    ax.set_title(f"issue-10 DLRM, batch {a.batch_size}/rank, CPU, 1 thread/rank ({datetime.date.today()})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_section(path: Path, text: str) -> None:
    """Replace (or add) this machine's part (``### <CPU model> (<ISA>)``) of this script's section of
    ``docs/benchmarks.md``; other machines' figures stay beside it; keep its ``Reading:``."""
    body = text.split("\n", 1)[1].lstrip("\n") if text.startswith(SECTION) else text
    replace_machine_section(path, SECTION, machine_heading(), body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--window", type=int, default=10, help="steps per throughput sample")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--shrink", type=int, default=1, help="divide table rows by this (tests)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per variant run")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled shardrec run")
    p.add_argument("--plot", type=Path, default=None, help="PNG of samples/s per variant")
    p.add_argument("--write-docs", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="copy the raw per-rank results here")
    p.add_argument("--quick", action="store_true", help="smoke run: tables 1/100, batch 128, 1 round of 2+4 steps")
    # worker mode (internal)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        WORKERS[a.worker](WorkerArgs(a.worker, a.data, a.out, a.warmup, a.steps, a.shrink, a.batch_size, a.profile))
        return
    if a.quick:
        a.rounds, a.warmup, a.steps, a.window, a.batch_size, a.shrink = 1, 2, 4, 2, 128, 100
        a.no_profile = True
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; available: {', '.join(VARIANTS)}")
    failures: dict[str, str] = {}
    if "torchrec_dmp" in variants and not (TORCHREC_VENV / "bin" / "python").exists():
        failures["torchrec_dmp"] = "no benchmarks/.venv-torchrec (run benchmarks/setup_torchrec_venv.sh)"
        variants.remove("torchrec_dmp")

    a.load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="e2e_bench_"))
    try:
        data, out = work / "data", work / "out"
        data.mkdir()
        out.mkdir()
        t = time.perf_counter()
        make_batch_files(data, a.warmup + a.steps, a.batch_size, a.shrink)
        print(f"e2e_bench: batches generated in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
        order = list(variants)
        shuffle = random.Random(0)
        for rnd in range(a.rounds):
            shuffle.shuffle(order)
            for v in order:
                if v in failures:
                    continue
                t = time.perf_counter()
                err = run_variant(v, a, data, out)
                if err:
                    failures[v] = " ".join(err.split())[-400:].replace("|", "/")
                    print(f"e2e_bench: {v} failed: {err}", file=sys.stderr)
                    runs[v] = []
                    continue
                results = [read_result(f) for f in sorted(out.glob(f"{v}.rank*.json"))]
                runs[v].append(results)
                if a.keep is not None:
                    a.keep.mkdir(parents=True, exist_ok=True)
                    for f in out.glob(f"{v}.rank*.json"):
                        shutil.copy(f, a.keep / f"round{rnd}.{f.name}")
                print(
                    f"e2e_bench: round {rnd} {v}: {whole(results):,.0f} samples/s "
                    f"({time.perf_counter() - t:.1f} s wall)",
                    file=sys.stderr,
                )
        profile = None
        if not a.no_profile and "shardrec" in variants and "shardrec" not in failures:
            prof_path = work / "profile.json"
            err = run_variant("shardrec", a, data, out, profile=prof_path)
            if err:
                print(f"e2e_bench: profiled run failed: {err}", file=sys.stderr)
            else:
                profile = json.loads(prof_path.read_text())
                if a.keep is not None:
                    a.keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy(prof_path, a.keep / "profile.json")
                    for name in ("slowest", "median"):
                        (a.keep / f"profile_{name}.txt").write_text(profile[name]["table"])
        plot = a.plot if a.plot is not None and make_plot(a.plot, a, runs) else None
        cmd = "python benchmarks/e2e_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
        text = report(a, runs, failures, profile, cmd.strip(), plot)
        print(text)
        if a.write_docs is not None:
            write_section(a.write_docs, text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
