"""Calibrate the planner's cost model on this machine, then check it against measured steps.

    python benchmarks/calibrate.py measure --out rates.json      # this machine's rates (~40 s)
    python benchmarks/calibrate.py check --rates rates.json \\
        [--write-docs docs/planner.md --plot docs/img/planner_calibration.png]   # 8 plans on 2x2 ranks (~1 min)

``measure`` (on 4 gloo ranks pretending 2 hosts x 2 ranks, ``LOCAL_WORLD_SIZE=2``; every part timed
on all ranks at once, as they run in a step) writes a JSON file ``Topology(rates=...)`` loads:

- the embedding kernel (fastest backend, forward + fused adagrad update) on several table shapes:
  ``lookup_seconds + bytes / memory_bw`` by least squares;
- all-to-alls in a host and over all ranks, row-wise's reduce-scatter + all-gather: bandwidths as
  the slope between a small and a large call;
- a replicated 64-wide table's step at two sizes: its dense gradient and adagrad update with DDP over
  a group of one rank (bucket copies, no all-reduce) give ``dense_bw``; with DDP over all ranks, what
  the bucketed all-reduce adds (overlapping the backward, as in a step) gives ``allreduce_bw``;
- tiny-table steps, interleaved in rounds (:data:`PARTS`): the fixed step (a tiny replicated table),
  then one table per mechanism; the seconds each adds, divided by the calls it adds (counted,
  ``planner/rates.py``), give the in-step seconds per all-to-all, in-host all-to-all and
  reduce-scatter/all-gather; pairs of mechanisms the seconds per further group, six tables per table.

``check`` plans one model with 8 layouts (``benchmarks/_calibrate_runs.py``) for
``Topology(4, local_world_size=2, rates=...)``, times them interleaved in rounds, counts each step's
collective calls (``benchmarks/_comm_count.py``) against the model's, and compares ``step_estimate``
with the measured step (``benchmarks/_calibrate_report.py``: the docs section and the plot).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _calibrate_report import SECTION, Row, as_calls, calls_text, report, scatter
from _calibrate_runs import (
    BATCH,
    FIXED,
    LOCAL,
    PLANS,
    POOLING,
    TINY,
    WORLD,
    Measured,
    check_rank,
    plan_for,
    summarize,
    timed,
    tiny_plan,
    train_step,
)
from _report import replace_section  # noqa: E402

from lightning_shardrec import FusedOptimConfig
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.planner import Rates, ShardingPlan, Topology, step_estimate
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
    bw = [n / max(b - a, 1e-9) for n, a, b in zip(sent, small, large, strict=True)]
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


#: the tiny-table steps that measure the fixed step, what each kind of call costs inside a step, what a
#: further sharding group and a further table cost (:func:`measure_step_parts`)
PARTS: dict[str, list[str]] = {
    "base": ["data_parallel"],
    "tw": ["table_wise"],
    "rw": ["row_wise"],
    "host": ["table_row_wise"],
    "tw+rw": ["table_wise", "row_wise"],
    "tw+host": ["table_wise", "table_row_wise"],
    "tw x6": ["table_wise"] * 6,  # 64 wide, round robin over the ranks: what a further table costs in a plan
    "tw wide": ["table_wise"],  # 128 wide: how much slower a step's all-to-alls move bytes than alone
}
#: the tiny tables' width where it is not ``TINY``'s
WIDTH = {"tw x6": 64, "tw wide": 128}


def _tiny(name: str, topo: Topology | None = None) -> tuple[dict[str, tuple[int, int]], ShardingPlan]:
    return tiny_plan(PARTS[name], topo, WIDTH.get(name, TINY[1]))


def parts_rank(rank: int, world: int, steps: int, rounds: int) -> dict[str, list[list[float]]]:
    """Step seconds of every :data:`PARTS` model, interleaved in rounds (as ``check`` times its plans)."""
    with local_world_size(LOCAL):
        steps_of = {name: train_step(rank, *_tiny(name)) for name in PARTS}
        for step in steps_of.values():
            step()
        times: dict[str, list[list[float]]] = {name: [] for name in PARTS}
        for _ in range(rounds):
            for name, step in steps_of.items():
                step()
                times[name].append(timed(step, steps))
        return times


def measure_step_parts(rates: Rates, steps: int = 10, rounds: int = 5) -> dict[str, float]:
    """The fixed step (a tiny replicated table: dense model, header, DDP's all-reduce) and, by the calls
    :data:`~lightning_shardrec.planner.rates.MECHANISM_CALLS` counts, the in-step seconds per all-to-all
    (table-wise's 4), per in-host all-to-all (table-row-wise's 2 more), per reduce-scatter or all-gather
    (row-wise's, beside its 2 all-to-alls); a further group's and a further table's seconds.

    Each tiny step is taken net of what the model already charges it (``rates``' bandwidths and
    kernel: the plan's slowest rank), so its bytes are not counted twice."""
    res = run_ranks(parts_rank, WORLD, steps, rounds, timeout=600)
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=rates)
    charged = {name: _tiny(name, topo)[1].stats.max_cost for name in PARTS}
    t = {name: summarize([r[name] for r in res]).seconds - charged[name] for name in PARTS}
    # a 128-wide table's all-to-alls against an 8-wide one's: how much slower bytes move in a step than alone
    modeled = charged["tw wide"] - charged["tw"]
    slower = max(1.0, (t["tw wide"] - t["tw"] + modeled) / modeled)
    a2a = max(0.0, (t["tw"] - t["base"]) / 4)
    pair = statistics.fmean(
        [t["tw+rw"] - t["tw"] - t["rw"] + t["base"], t["tw+host"] - t["tw"] - t["host"] + t["base"]]
    )
    return {
        "step_seconds": t["base"],
        "collective_seconds": a2a,
        "host_call_seconds": max(0.0, (t["host"] - t["base"] - 4 * a2a) / 2),
        "reduce_scatter_seconds": max(0.0, (t["rw"] - t["base"] - 2 * a2a) / 2),
        "group_seconds": max(0.0, pair),
        "table_seconds": max(0.0, (t["tw x6"] - t["tw"]) / 5),
        "intra_host_bw": rates.intra_host_bw / slower,
        "inter_host_bw": rates.inter_host_bw / slower,
    }


def measure_rates(out: Path) -> Rates:
    lookup, memory_bw = measure_kernel()
    source = (
        f"benchmarks/calibrate.py on {cpu_model()}, {torch.get_num_threads()} thread per rank, "
        f"{WORLD} gloo ranks as 2 hosts x {LOCAL}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.1f} at its start"
    )
    parts = ("step_seconds", "collective_seconds", "host_call_seconds", "reduce_scatter_seconds")
    rates = Rates(
        memory_bw=memory_bw,
        lookup_seconds=lookup,
        **measure_collectives(),
        **measure_dense(),
        **dict.fromkeys((*parts, "group_seconds", "table_seconds"), 0.0),
        source=source,
    )
    alone = f"in-host {rates.intra_host_bw / 1e9:.2f} GB/s, between hosts {rates.inter_host_bw / 1e9:.2f} GB/s"
    print(f"all-to-all alone: {alone}")
    rates = replace(rates, **measure_step_parts(rates))
    rates.save(out)
    print(rates)
    return rates


# --- check -------------------------------------------------------------------------------------
def check(rates: Rates, steps: int, rounds: int) -> tuple[list[Row], Measured]:
    """Every plan of :data:`PLANS`: ``step_estimate`` against the measured step, and its calls counted;
    and the fixed step measured in the same rounds."""
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
    fixed = summarize([r[1][FIXED] for r in res])
    print(f"fixed step: {rates.step_seconds * 1e3:.2f} ms in measure, {fixed.seconds * 1e3:.2f} ms in these rounds")
    return rows, fixed


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
    rows, fixed = check(rates, args.steps, args.rounds)
    load = load_text(before, os.getloadavg()[0], args.load)
    if args.plot:
        scatter(
            rows,
            args.plot,
            f"Planner estimate vs measured, {WORLD // LOCAL} hosts x {LOCAL} ranks\n{cpu_model()}, {load}",
        )
    text = report(rows, fixed, rates, load, args.steps, args.rounds, args.plot)
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, SECTION, text)


if __name__ == "__main__":
    main()
