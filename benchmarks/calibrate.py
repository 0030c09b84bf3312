"""Calibrate the planner's cost model on this machine, then check it against measured steps.

    python benchmarks/calibrate.py measure --out rates.json      # this machine's rates (~1 min)
    python benchmarks/calibrate.py check --rates rates.json \\
        [--write-docs docs/planner.md --plot docs/img/planner_calibration.png]   # 7 plans on 2x2 ranks

``measure`` times the embedding kernel (fastest backend, forward + fused adagrad update) on
several table shapes, on all 4 ranks at once as they run in a step, and fits
``lookup_seconds + bytes / memory_bw``; on 4 gloo ranks pretending 2 hosts x 2 ranks
(``LOCAL_WORLD_SIZE=2``) it times all-to-alls: tiny ones give the per-collective latency,
1 MiB per destination inside a host and over all ranks the intra- and between-host bandwidths,
a 4 MiB all-reduce the all-reduce bandwidth; a one-row table-wise model gives the fixed step
(one sharding type's collectives, one lookup, the dense model and its all-reduce), six of
them the seconds per further table. It writes a JSON file ``Topology(rates=...)`` loads.
``check`` plans one model for ``Topology(4, local_world_size=2, rates=...)`` with 7 forced
layouts and compares ``step_estimate`` with the measured step.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _calibrate_report import SECTION, Row, as_calls, calls_text, report, scatter
from _calibrate_runs import (
    BATCH,
    LOCAL,
    PLANS,
    POOLING,
    WORLD,
    check_rank,
    model,
    plan_for,
    summarize,
    timed,
    train_step,
)
from _report import replace_section  # noqa: E402

from lightning_shardrec import FusedOptimConfig
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Rates, Topology, step_estimate
from lightning_shardrec.planner.rates import step_calls
from lightning_shardrec.testing import local_world_size, run_ranks

SHAPES = [(20_000, 16, 256), (20_000, 64, 256), (100_000, 128, 256), (100_000, 64, 1024), (5_000, 32, 2048)]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


# --- measure ---------------------------------------------------------------------------------
def kernel_bytes(ids: float, cols: int) -> float:
    """The bytes the cost model charges a lookup + adagrad update (``planner/perf.py``: ``_compute``)."""
    state = EmbOptimType.ADAGRAD.state_per_row(cols)
    return ids * cols * 4 + ids * (cols * 4 + 2 * cols * 4 + 2 * state * 4)


def kernel_rank(rank: int, world: int) -> list[tuple[float, float]]:
    """(bytes, fastest seconds) per shape in :data:`SHAPES`, timed on every rank at once (they share the cores)."""
    from lightning_shardrec import kernels as k
    from lightning_shardrec.kernels import TableSpec, Workload, runnable
    from lightning_shardrec.kernels import autotune as at
    from lightning_shardrec.kernels.autotune import measure

    optim = FusedOptimConfig(optimizer="adagrad", lr=0.01)
    out = []
    for rows, dim, batch in SHAPES:
        ok = [b for b, why in runnable(torch.device("cpu"), optim, [dim]).items() if why is None]
        classes = {b.value: k._BACKENDS[b] for b in ok}
        old = at.ROW_CAP
        at.ROW_CAP = max(old, rows)
        try:
            m = measure(
                classes,
                [TableSpec(name="t", num_embeddings=rows, embedding_dim=dim)],
                [0],
                optim,
                pooled=True,
                device=torch.device("cpu"),
                workload=Workload(batch_size=batch, pooling=POOLING),
            )
        finally:
            at.ROW_CAP = old
        out.append((kernel_bytes(batch * POOLING, dim), min(m.values())))
    return out


def measure_kernel() -> tuple[float, float]:
    """``lookup_seconds`` and ``memory_bw``: a least-squares line through the shapes' median times over the ranks."""
    per_rank = run_ranks(kernel_rank, WORLD)
    xs = [x for x, _ in per_rank[0]]
    ys = [statistics.median(r[i][1] for r in per_rank) for i in range(len(xs))]
    for (rows, dim, batch), x, y in zip(SHAPES, xs, ys, strict=True):
        print(f"kernel {rows}x{dim} batch {batch}: {y * 1e3:.3f} ms for {x / 1e6:.2f} MB", flush=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return max(0.0, my - slope * mx), 1.0 / slope


def collectives_rank(rank: int, world: int) -> tuple[float, ...]:
    """Median seconds: a tiny all-to-all, 1 MiB per destination in-host and over all ranks, a row-wise
    reduce-scatter and all-gather of a 1 MiB partial, a 16 MiB all-reduce (a DDP bucket's order of size)."""
    import torch.distributed as dist

    with local_world_size(LOCAL):
        groups = [dist.new_group(list(range(h * LOCAL, (h + 1) * LOCAL))) for h in range(world // LOCAL)]
        mine = groups[rank // LOCAL]

        def a2a(per_dest: int, group=None, n: int = world) -> None:  # type: ignore[no-untyped-def]
            x = torch.ones(per_dest * n)
            dist.all_to_all_single(torch.empty_like(x), x, group=group)

        partial, block = torch.ones(1 << 18), torch.empty((1 << 18) // world)

        def reduce_scatter_and_gather() -> None:
            dist.reduce_scatter_single(block, partial)
            dist.all_gather_single(partial, block)

        grad = torch.ones(1 << 22)
        big = 1 << 18  # floats per destination: 1 MiB
        return tuple(
            statistics.median(timed(fn, reps))
            for fn, reps in (
                (lambda: a2a(2), 30),
                (lambda: a2a(big, mine, LOCAL), 10),
                (lambda: a2a(big), 10),
                (reduce_scatter_and_gather, 10),
                (lambda: dist.all_reduce(grad), 5),
            )
        )


def measure_collectives() -> dict[str, float]:
    """``collective_seconds`` and the bandwidths, from the ranks' medians (bytes that leave a rank)."""
    res = run_ranks(collectives_rank, WORLD)
    latency, t_host, t_all, t_rs, t_reduce = (statistics.median(r[i] for r in res) for i in range(5))
    mib, left = 1 << 20, (WORLD - 1) / WORLD

    def rate(nbytes: float, seconds: float, calls: int = 1) -> float:
        return nbytes / max(seconds - calls * latency, 1e-9)

    return {
        "collective_seconds": latency,
        "intra_host_bw": rate(mib * (LOCAL - 1), t_host),
        "inter_host_bw": rate(mib * (WORLD - 1), t_all),
        "reduce_scatter_bw": rate(2 * mib * left, t_rs, 2),
        "allreduce_bw": rate(2 * left * 16 * mib, t_reduce),  # the ring bytes the cost model charges
    }


def dense_rank(rank: int, world: int) -> list[tuple[float, float]]:
    """(table bytes, median seconds) of a replicated table's step without its all-reduce, two sizes.

    Forward and backward of a lookup into a 64-wide table (a dense gradient of the whole table), DDP
    over a group of this rank alone (its bucket copies, no all-reduce), and adagrad over the table.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    alone = [dist.new_group([r]) for r in range(world)][rank]

    def replicated(rows: int) -> Callable[[], None]:
        table = torch.nn.EmbeddingBag(rows, 64, mode="sum")
        ddp = torch.nn.parallel.DistributedDataParallel(table, process_group=alone)
        opt = torch.optim.Adagrad(table.parameters(), lr=0.01)
        ids = torch.randint(0, rows, (BATCH * POOLING,), generator=torch.Generator().manual_seed(rank))
        offsets = torch.arange(0, ids.numel(), POOLING)

        def step() -> None:
            opt.zero_grad()
            F.relu(ddp(ids, offsets)).sum().backward()
            opt.step()

        step()
        return step

    return [(rows * 64 * 4, statistics.median(timed(replicated(rows), 5))) for rows in (20_000, 200_000)]


def measure_dense() -> float:
    """``dense_bw``: table bytes per second of the slope between the two sizes (every rank at once)."""
    res = run_ranks(dense_rank, WORLD)
    (x0, _), (x1, _) = res[0]
    y0, y1 = (statistics.median(r[i][1] for r in res) for i in (0, 1))
    return (x1 - x0) / max(y1 - y0, 1e-9)


def fixed_rank(rank: int, world: int, tables: int, steps: int) -> list[float]:
    """Step seconds of ``tables`` one-row table-wise tables, all on rank 0 (the fixed step)."""
    with local_world_size(LOCAL):
        tiny = {f"t{i}": (1, 8) for i in range(tables)}
        topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL)
        pinned = {
            t: ParameterConstraints(sharding_types=["table_wise"], ranks=[0], pooling_factors=[1.0]) for t in tiny
        }
        plan = EmbeddingShardingPlanner(topo, batch_size=BATCH, constraints=pinned).plan(model(tiny))
        step = train_step(rank, tiny, plan)
        step()
        return timed(step, steps)


def fixed_step(steps: int = 20) -> tuple[float, float]:
    """The fixed step (one one-row table), and the extra seconds per further table (from six)."""
    one = statistics.median(max(t) for t in zip(*run_ranks(fixed_rank, WORLD, 1, steps), strict=True))
    six = statistics.median(max(t) for t in zip(*run_ranks(fixed_rank, WORLD, 6, steps), strict=True))
    return one, max(0.0, (six - one) / 5)


def measure_rates(out: Path) -> Rates:
    lookup, memory_bw = measure_kernel()
    comm = measure_collectives()
    dense_bw = measure_dense()
    step, per_table = fixed_step()
    rates = Rates(
        memory_bw=memory_bw,
        lookup_seconds=lookup,
        dense_bw=dense_bw,
        step_seconds=step,
        table_seconds=per_table,
        source=f"benchmarks/calibrate.py on {cpu_model()}, {torch.get_num_threads()} thread per rank, "
        f"{WORLD} gloo ranks as 2 hosts x {LOCAL}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        **comm,
    )
    rates.save(out)
    print(rates)
    return rates


# --- check -------------------------------------------------------------------------------------
def check(rates: Rates, steps: int, rounds: int) -> list[Row]:
    """Every plan of :data:`PLANS`: ``step_estimate`` against the measured step, and its calls counted."""
    names = list(PLANS)
    res = run_ranks(check_rank, WORLD, names, rates, steps, rounds, timeout=600)
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=rates)
    rows: list[Row] = []
    layouts: list[object] = []
    for n in names:
        plan = plan_for(n, rates)
        same = next((r.name for r, p in zip(rows, layouts, strict=True) if p == plan.plan), None)
        layouts.append(plan.plan)
        counted = as_calls(res[0][0][n])
        others = [as_calls(r[0][n]) for r in res[1:]]
        if any(c != counted for c in others):
            raise RuntimeError(f"plan {n}: the ranks counted different calls: {[counted, *others]}")
        row = Row(
            n, step_estimate(plan, topo), summarize([r[1][n] for r in res]), counted, step_calls(plan, LOCAL), same
        )
        rows.append(row)
        m = row.measured
        print(
            f"{n:15s} estimated {row.estimate * 1e3:8.2f} ms  measured {m.seconds * 1e3:8.2f} ms "
            f"[{m.lo * 1e3:.2f}-{m.hi * 1e3:.2f}]  ({row.error:+.0%})  calls {calls_text(counted)}"
            + ("" if row.modeled == counted else f"  model: {calls_text(row.modeled)}"),
            flush=True,
        )
    return rows


def load_text(before: float, after: float, note: str) -> str:
    quiet = max(before, after) < 1.5
    text = f"load average {before:.1f} before, {after:.1f} after ({'quiet' if quiet else 'loaded'} machine"
    return text + (f", {note})" if note else ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, default=Path("rates.json"))
    c = sub.add_parser("check")
    c.add_argument("--rates", type=Path, required=True)
    c.add_argument("--steps", type=int, default=10, help="timed steps per plan and round")
    c.add_argument("--rounds", type=int, default=5, help="rounds, the plans interleaved in each")
    c.add_argument("--write-docs", type=Path)
    c.add_argument("--plot", type=Path)
    c.add_argument("--load", default="", help="a note on the machine's load, e.g. 'loaded machine (4 engineers)'")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "measure":
        measure_rates(args.out)
        return
    rates = Rates.load(args.rates)
    before = os.getloadavg()[0]
    rows = check(rates, args.steps, args.rounds)
    load = load_text(before, os.getloadavg()[0], args.load)
    if args.plot:
        scatter(
            rows,
            args.plot,
            f"Planner estimate vs measured, {WORLD // LOCAL} hosts x {LOCAL} ranks\n{cpu_model()}, {load}",
        )
    text = report(rows, rates, load, args.steps, args.rounds, args.plot)
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, SECTION, text)


if __name__ == "__main__":
    main()
