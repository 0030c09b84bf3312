"""Calibrate the planner's cost model on this machine, then check it against measured steps.

    python benchmarks/calibrate.py measure --out rates.json      # this machine's rates (~40 s)
    python benchmarks/calibrate.py check --rates rates.json \\
        [--write-docs docs/planner.md --plot docs/img/planner_calibration.png]   # 8 plans on 2x2 ranks (~1.5 min)

``measure`` (on 4 gloo ranks pretending 2 hosts x 2 ranks, ``LOCAL_WORLD_SIZE=2``; every part timed
on all ranks at once, as they run in a step) writes a JSON file ``Topology(rates=...)`` loads:

- the embedding kernel (fastest backend, forward + fused adagrad update) on 4-row tables of several
  widths and batches (rows in cache: the cost per id): ``lookup_seconds + bytes / memory_bw`` by least
  squares;
- all-to-alls in a host and over all ranks, row-wise's reduce-scatter + all-gather: bandwidths as
  the slope between a small and a large call;
- a replicated 64-wide table's step at two sizes: its dense gradient and adagrad update with DDP over
  a group of one rank (bucket copies, no all-reduce) give ``dense_bw``; with DDP over all ranks, what
  the bucketed all-reduce adds (overlapping the backward, as in a step) gives ``allreduce_bw``;
- probe steps, interleaved in rounds (``_calibrate_probes.PROBES``): the fixed step (a tiny replicated
  table), then one table per mechanism; the seconds each adds, divided by the calls it adds (counted,
  ``planner/machine/rates.py``), give the in-step seconds per all-to-all, in-host all-to-all and
  reduce-scatter/all-gather; pairs of mechanisms the seconds per further group, six tables per table,
  tables of many rows the seconds per byte of distinct rows, a large replicated table the in-step
  replicated rates (``_calibrate_probes.step_parts``).

``check`` plans one model with 8 layouts (``benchmarks/_calibrate_runs.py``) for
``Topology(4, local_world_size=2, rates=...)``, times them interleaved in rounds, counts each step's
collective calls (``benchmarks/_comm_count.py``) against the model's, and compares ``step_estimate``
with the measured step (``benchmarks/_calibrate_report.py``: the docs section and the plot).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _calibrate_probes import step_parts
from _calibrate_report import SECTION, Row, as_calls, busiest, calls_text, report, scatter
from _calibrate_runs import BATCH, LOCAL, PLANS, POOLING, WORLD, Measured, check_rank, plan_for, summarize, timed
from harness import cpu_model, replace_section  # noqa: E402

from lightning_shardrec import FusedOptimConfig
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.planner import Rates, Topology, step_estimate
from lightning_shardrec.planner.machine.rates import step_calls
from lightning_shardrec.testing import local_world_size, run_ranks

#: (rows, dim, batch) the kernel is timed on: 4 rows, so its rows stay in cache and the fit is the cost per id;
#: rows read from memory are the distinct rows' cost, measured inside a step (``_calibrate_probes``)
SHAPES = [(4, 16, 256), (4, 64, 256), (4, 128, 256), (4, 64, 1024), (4, 32, 2048)]


# --- measure ---------------------------------------------------------------------------------
def kernel_bytes(ids: float, cols: int) -> float:
    """The bytes the cost model charges a lookup + adagrad update (``planner/costs/perf.py``: ``_compute``)."""
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


#: floats per destination (all-to-alls) or per rank (reduce-scatter) of the small and the large calls
SIZES = (1 << 14, 1 << 19)


def collectives_rank(rank: int, world: int) -> list[tuple[float, ...]]:
    """Per size of :data:`SIZES`, median seconds of an all-to-all in-host and over all ranks, and a row-wise
    reduce-scatter + all-gather (``W`` times the size)."""
    import torch.distributed as dist

    with local_world_size(LOCAL):
        groups = [dist.new_group(list(range(h * LOCAL, (h + 1) * LOCAL))) for h in range(world // LOCAL)]
        mine = groups[rank // LOCAL]

        def a2a(per_dest: int, group=None, n: int = world) -> None:  # type: ignore[no-untyped-def]
            x = torch.ones(per_dest * n)
            dist.all_to_all_single(torch.empty_like(x), x, group=group)

        def reduce_scatter_and_gather(partial: torch.Tensor, block: torch.Tensor) -> None:
            dist.reduce_scatter_single(block, partial)
            dist.all_gather_single(partial, block)

        out = []
        for size in SIZES:
            partial, block = torch.ones(size * world), torch.empty(size)
            fns = (
                lambda size=size: a2a(size, mine, LOCAL),
                lambda size=size: a2a(size),
                lambda p=partial, b=block: reduce_scatter_and_gather(p, b),
            )
            out.append(tuple(statistics.median(timed(fn, 7)) for fn in fns))
        return out


def measure_collectives() -> dict[str, float]:
    """The bandwidths: bytes that leave a rank per second, between the small and the large calls (the
    slope, so a call's fixed cost, charged per call in a step, is not counted again)."""
    res = run_ranks(collectives_rank, WORLD)
    small, large = ([statistics.median(r[i][k] for r in res) for k in range(3)] for i in (0, 1))
    floats = SIZES[1] - SIZES[0]
    left = (WORLD - 1) / WORLD
    sent = [4 * floats * (LOCAL - 1), 4 * floats * (WORLD - 1), 2 * 4 * floats * WORLD * left]
    # under load the two medians can come out nearly equal (or reversed): a slope under 5% of the large
    # call's time is noise, and then the large call's own rate (a lower bound) stands in
    bw = [n / (b - a if b - a > 0.05 * b else b) for n, a, b in zip(sent, small, large, strict=True)]
    names = ("intra_host_bw", "inter_host_bw", "reduce_scatter_bw")
    return dict(zip(names, bw, strict=True))


DENSE_ROWS = (20_000, 200_000)  # a replicated 64-wide table's two sizes (5 and 51 MB)


def dense_rank(rank: int, world: int) -> list[list[float]]:
    """Median seconds of a replicated table's step, per group (this rank alone, all ranks) and size.

    Forward and backward of a lookup into a 64-wide table (a dense gradient of the whole table), DDP
    (alone: its bucket copies but no all-reduce; over all ranks: its bucketed all-reduce, overlapping
    the backward as in a step), and adagrad over the table.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    alone = [dist.new_group([r]) for r in range(world)][rank]

    def replicated(rows: int, group: dist.ProcessGroup) -> Callable[[], None]:
        table = torch.nn.EmbeddingBag(rows, 64, mode="sum")
        ddp = torch.nn.parallel.DistributedDataParallel(table, process_group=group)
        opt = torch.optim.Adagrad(table.parameters(), lr=0.01)
        ids = torch.randint(0, rows, (BATCH * POOLING,), generator=torch.Generator().manual_seed(rank))
        offsets = torch.arange(0, ids.numel(), POOLING)

        def step() -> None:
            opt.zero_grad()
            F.relu(ddp(ids, offsets)).sum().backward()
            opt.step()

        step()
        return step

    world_group = dist.new_group(list(range(world)))
    return [[statistics.median(timed(replicated(rows, g), 5)) for rows in DENSE_ROWS] for g in (alone, world_group)]


def measure_dense() -> dict[str, float]:
    """``dense_bw`` (table bytes/s of the step alone) and ``allreduce_bw`` (ring bytes/s that the step over
    all ranks adds): slopes between the two sizes, the slowest rank's median."""
    res = run_ranks(dense_rank, WORLD)
    alone, every = ([max(r[g][i] for r in res) for i in range(2)] for g in (0, 1))
    table = (DENSE_ROWS[1] - DENSE_ROWS[0]) * 64 * 4
    ring = 2 * (WORLD - 1) / WORLD * table
    local = max(alone[1] - alone[0], 1e-9)
    return {"dense_bw": table / local, "allreduce_bw": ring / max(every[1] - every[0] - local, 0.05 * local)}


def measure_step_parts(rates: Rates, steps: int = 10, rounds: int = 5) -> dict[str, float]:
    """The in-step rates of the probe steps (``_calibrate_probes.PROBES``), timed interleaved in rounds
    (:func:`~_calibrate_probes.step_parts`; ``check`` times the same steps in its own rounds)."""
    res = run_ranks(check_rank, WORLD, [], None, steps, rounds, timeout=600)
    return step_parts(rates, [r[1] for r in res])


def cpus() -> int:
    """The cores this process may run on (its affinity; ``os.cpu_count()`` where that is unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure_rates(out: Path) -> Rates:
    lookup, memory_bw = measure_kernel()
    cores = cpus()
    source = (
        f"benchmarks/calibrate.py on {cpu_model()}, {torch.get_num_threads()} thread per rank, "
        f"{WORLD} gloo ranks as 2 hosts x {LOCAL} on {cores} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.1f} at its start"
    )
    parts = ("step_seconds", "collective_seconds", "host_call_seconds", "reduce_scatter_seconds")
    rates = Rates(
        memory_bw=memory_bw,
        lookup_seconds=lookup,
        **measure_collectives(),
        **measure_dense(),
        **dict.fromkeys(
            (*parts, "group_seconds", "table_seconds", "host_table_seconds", "row_seconds", "row_byte_seconds"), 0.0
        ),
        ranks_per_core=max(1.0, WORLD / cores),
        source=source,
    )
    alone = f"in-host {rates.intra_host_bw / 1e9:.2f} GB/s, between hosts {rates.inter_host_bw / 1e9:.2f} GB/s"
    print(f"all-to-all alone: {alone}")
    rates = replace(rates, **measure_step_parts(rates))
    rates.save(out)
    print(rates)
    return rates


# --- check -------------------------------------------------------------------------------------
def check(rates: Rates, steps: int, rounds: int) -> tuple[list[Row], Measured, Rates]:
    """Every plan of :data:`PLANS`: ``step_estimate`` against the measured step, and its calls counted.

    The tiny-table steps run in the same rounds; the estimate takes its in-step rates (the fixed step,
    seconds per call, group and piece, the all-to-alls' in-step bandwidths:
    :func:`~_calibrate_runs.step_parts`) from them and prices each timed layout at those, so estimate
    and measurement see the same load. Returns the rows, the fixed step as measured, and the rates used."""
    names = list(PLANS)
    res = run_ranks(check_rank, WORLD, names, rates, steps, rounds, timeout=600)
    parts = step_parts(rates, [r[1] for r in res])
    in_step = replace(rates, **parts)
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=in_step)
    rows: list[Row] = []
    layouts: list[object] = []
    for n in names:
        plan = plan_for(n, rates)  # the layout timed; priced at the same-round rates below
        same = next((r.name for r, p in zip(rows, layouts, strict=True) if p == plan.plan), None)
        layouts.append(plan.plan)
        # a host that holds no table_row_wise piece makes no in-host calls: the busiest rank's, per kind
        counted = busiest([as_calls(r[0][n]) for r in res])
        row = Row(
            n,
            step_estimate(plan_for(n, in_step, plan), topo),
            summarize([r[1][n] for r in res]),
            counted,
            step_calls(plan, LOCAL),
            same,
        )
        rows.append(row)
        m = row.measured
        print(
            f"{n:15s} estimated {row.estimate * 1e3:8.2f} ms  measured {m.seconds * 1e3:8.2f} ms "
            f"[{m.lo * 1e3:.2f}-{m.hi * 1e3:.2f}]  ({row.error:+.0%})  calls {calls_text(counted)}"
            + ("" if row.modeled == counted else f"  model: {calls_text(row.modeled)}"),
            flush=True,
        )
    fixed = summarize([r[1]["base"] for r in res])
    print(f"fixed step: {rates.step_seconds * 1e3:.2f} ms in measure, {fixed.seconds * 1e3:.2f} ms in these rounds")
    return rows, fixed, in_step


def load_text(before: float, after: float, note: str) -> str:
    """The load averages around a run and what the machine ran besides (``note``; else judged from the load,
    which the run's own 4 ranks on 2 cores raise to about 3)."""
    text = f"load average {before:.1f} before, {after:.1f} after"
    return text + f" ({note or ('quiet machine' if max(before, after) < 1.5 else 'loaded machine')})"


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
    rows, fixed, in_step = check(rates, args.steps, args.rounds)
    load = load_text(before, os.getloadavg()[0], args.load)
    if args.plot:
        scatter(
            rows,
            args.plot,
            f"Planner estimate vs measured, {WORLD // LOCAL} hosts x {LOCAL} ranks\n{cpu_model()}, {load}",
        )
    text = report(rows, fixed, in_step, rates, load, args.steps, args.rounds, args.plot)
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, SECTION, text)


if __name__ == "__main__":
    main()
