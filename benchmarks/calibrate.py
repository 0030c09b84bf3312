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
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import replace_section  # noqa: E402

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Rates,
    Topology,
    step_estimate,
)
from lightning_shardrec.testing import local_world_size, run_ranks

WORLD, LOCAL = 4, 2
BATCH = 256  # per rank
POOLING = 4
# name: (rows, dim)
TABLES = {
    "t0": (100_000, 64),
    "t1": (50_000, 64),
    "t2": (20_000, 32),
    "t3": (5_000, 32),
    "t4": (1_000, 16),
    "t5": (200, 16),
}
PLANS = ["table_wise", "column_wise", "row_wise", "table_row_wise", "grid_shard", "data_parallel", "planner"]
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


def _time(fn, reps: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def collectives_rank(rank: int, world: int) -> tuple[float, float, float, float]:
    """Per-collective latency, in-host and all-rank all-to-all bandwidth, all-reduce bandwidth."""
    import torch.distributed as dist

    with local_world_size(LOCAL):
        groups = [dist.new_group(list(range(h * LOCAL, (h + 1) * LOCAL))) for h in range(world // LOCAL)]
        mine = groups[rank // LOCAL]

        def a2a(per_dest: int, group=None, n: int = world) -> None:
            x = torch.ones(per_dest * n)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x, group=group)

        latency = _time(lambda: a2a(2), 30)
        big = 1 << 18  # floats per destination: 1 MiB
        t_all = _time(lambda: a2a(big), 10)
        t_host = _time(lambda: a2a(big, mine, LOCAL), 10)
        grad = torch.ones(big * world)
        t_reduce = _time(lambda: dist.all_reduce(grad), 10)
        off_all = big * 4 * (world - 1)
        off_host = big * 4 * (LOCAL - 1)
        ring = 2 * (world - 1) / world * grad.numel() * 4  # bytes the cost model charges an all-reduce
        return (
            latency,
            off_host / max(t_host - latency, 1e-9),
            off_all / max(t_all - latency, 1e-9),
            ring / max(t_reduce - latency, 1e-9),
        )


def fixed_step() -> tuple[float, float]:
    """A step of one one-row table-wise table, and the extra seconds per further table (6 such tables)."""
    one = max(run_ranks(train_rank, WORLD, "fixed", None, (20, 1)))
    six = max(run_ranks(train_rank, WORLD, "fixed", None, (20, 6)))
    return one, max(0.0, (six - one) / 5)


def measure_rates(out: Path) -> Rates:
    lookup, memory_bw = measure_kernel()
    res = run_ranks(collectives_rank, WORLD)
    latency = statistics.median(r[0] for r in res)
    intra = statistics.median(r[1] for r in res)
    inter = statistics.median(r[2] for r in res)
    allreduce = statistics.median(r[3] for r in res)
    step, per_table = fixed_step()
    rates = Rates(
        memory_bw=memory_bw,
        lookup_seconds=lookup,
        intra_host_bw=intra,
        inter_host_bw=inter,
        allreduce_bw=allreduce,
        collective_seconds=latency,
        step_seconds=step,
        table_seconds=per_table,
        source=f"benchmarks/calibrate.py on {cpu_model()}, {torch.get_num_threads()} threads, "
        f"{WORLD} gloo ranks as 2 hosts x {LOCAL}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    )
    rates.save(out)
    print(rates)
    return rates


# --- check -------------------------------------------------------------------------------------
def model(tables: dict[str, tuple[int, int]] = TABLES) -> torch.nn.Module:
    class Rec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=[f"f_{t}"])
                    for t, (n, d) in tables.items()
                ]
            )
            self.top = torch.nn.Linear(sum(d for _, d in tables.values()), 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.top(self.ebc(kjt).values()).squeeze(1)

    return Rec()


def constraints(kind: str) -> dict[str, ParameterConstraints]:
    out = {}
    for t, (_, d) in TABLES.items():
        types: list[str] | None = [kind]
        kernels = None
        if kind == "grid_shard" and d < 64:
            types = ["table_row_wise"]
        if kind == "data_parallel":
            kernels = ["dense"]
        if kind == "planner":
            types = None
        out[t] = ParameterConstraints(sharding_types=types, compute_kernels=kernels, pooling_factors=[float(POOLING)])
    return out


def plan_for(kind: str, rates: Rates | None):
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=rates)
    return EmbeddingShardingPlanner(topo, batch_size=BATCH, constraints=constraints(kind)).plan(model())


def batch(seed: int, tables: dict[str, tuple[int, int]] = TABLES) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = [f"f_{t}" for t in tables]
    values = torch.cat([torch.randint(0, n, (BATCH * POOLING,), generator=g) for n, _ in tables.values()])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.full((len(keys) * BATCH,), POOLING))


def train_rank(rank: int, world: int, kind: str, rates: Rates | None, steps_or_tables: tuple[int, int]) -> float:
    """Median seconds of ``steps`` training steps of plan ``kind`` (``fixed``: ``tables`` one-row tables on rank 0)."""
    steps = steps_or_tables[0]
    import torch.nn.functional as F

    from lightning_shardrec.distributed import DistributedModelParallel

    with local_world_size(LOCAL):
        if kind == "fixed":  # one 1-row table-wise table: one type's collectives, one lookup, the dense model
            tiny = {f"t{i}": (1, 8) for i in range(steps_or_tables[1])}
            topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL)
            dense_only = {
                t: ParameterConstraints(sharding_types=["table_wise"], ranks=[0], pooling_factors=[1.0]) for t in tiny
            }
            dmp = DistributedModelParallel(
                model(tiny),
                plan=EmbeddingShardingPlanner(topo, batch_size=BATCH, constraints=dense_only).plan(model(tiny)),
            )
            kjt = batch(rank, tiny)
            dense = torch.optim.Adagrad(list(dmp.dense_parameters()), lr=0.01)
            label = torch.rand(BATCH)

            def step() -> None:
                loss = F.binary_cross_entropy_with_logits(dmp(kjt), label)
                dense.zero_grad()
                loss.backward()
                dense.step()
        else:
            dmp = DistributedModelParallel(
                model(), plan=plan_for(kind, rates), embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=0.01)
            )
            dense = torch.optim.Adagrad(list(dmp.dense_parameters()), lr=0.01)
            kjt = batch(rank)
            label = torch.rand(BATCH)

            def step() -> None:
                loss = F.binary_cross_entropy_with_logits(dmp(kjt), label)
                dense.zero_grad()
                loss.backward()
                dense.step()

        for _ in range(3):
            step()
        return _time(step, steps)


def check(rates: Rates, steps: int) -> list[tuple[str, float, float]]:
    rows = []
    for kind in PLANS:
        est = step_estimate(plan_for(kind, rates), rates)
        measured = max(run_ranks(train_rank, WORLD, kind, rates, (steps, 0), timeout=600))
        rows.append((kind, est, measured))
        print(
            f"{kind:15s} estimated {est * 1e3:8.2f} ms  measured {measured * 1e3:8.2f} ms  ({est / measured - 1:+.0%})",
            flush=True,
        )
    return rows


def ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r + 1
    return out


def report(rows: list[tuple[str, float, float]], rates: Rates, load: str, plot: Path | None) -> str:
    er, mr = ranks([r[1] for r in rows]), ranks([r[2] for r in rows])
    lines = [
        "## Cost model against measured steps",
        "",
        "Calibrate, then check (a few minutes on 2 cores):",
        "",
        "```",
        "python benchmarks/calibrate.py measure --out rates.json",
        "python benchmarks/calibrate.py check --rates rates.json \\",
        "    --write-docs docs/planner.md --plot docs/img/planner_calibration.png",
        "```",
        "",
        "`Topology(..., rates='rates.json')` (or a `Rates`) opts in: the file's bandwidths replace the "
        "defaults, each shard's lookup pays the kernel's fixed `lookup_seconds`, and "
        "`step_estimate(plan, rates)` adds the fixed step and the per-collective latency. Without "
        "`rates` the planner and its plans are unchanged.",
        "",
        f"Rates: {rates.source}; {load}. memory {rates.memory_bw / 1e9:.2f} GB/s "
        f"+ {rates.lookup_seconds * 1e3:.3f} ms per lookup, "
        f"in-host {rates.intra_host_bw / 1e9:.2f} GB/s, between hosts {rates.inter_host_bw / 1e9:.2f} GB/s, "
        f"{rates.collective_seconds * 1e3:.3f} ms per collective, fixed step {rates.step_seconds * 1e3:.2f} ms "
        f"+ {rates.table_seconds * 1e3:.2f} ms per further table, all-reduce {rates.allreduce_bw / 1e9:.2f} GB/s.",
        "",
        f"Model: {len(TABLES)} tables ({', '.join(f'{n}x{d}' for n, d in TABLES.values())}), pooling {POOLING}, "
        f"batch {BATCH} per rank, adagrad, 2 hosts x 2 gloo ranks (pretend hosts, one machine). "
        "`grid_shard` row-blocks the 64-wide tables as grids and the others table-row-wise.",
        "",
        "| plan | estimated ms | measured ms | error | rank est. | rank meas. |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {e * 1e3:.2f} | {m * 1e3:.2f} | {e / m - 1:+.0%} | {a} | {b} |"
        for (k, e, m), a, b in zip(rows, er, mr, strict=True)
    ]
    within = sum(abs(e / m - 1) <= 0.25 for _, e, m in rows)
    lines += ["", f"{within} of {len(rows)} plans within 25%; ranking {'the same' if er == mr else 'differs'}."]
    if plot is not None:
        lines += ["", f"![estimated vs measured step time]({Path('img') / plot.name})"]
    return "\n".join(lines) + "\n"


def scatter(rows: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ms = [m * 1e3 for _, _, m in rows]
    es = [e * 1e3 for _, e, _ in rows]
    ax.scatter(ms, es)
    for (k, _, _), x, y in zip(rows, ms, es, strict=True):
        ax.annotate(k, (x, y), fontsize=8)
    lo, hi = min(ms + es) * 0.7, max(ms + es) * 1.4
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], alpha=0.15, label="within 25%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(loc="upper left")
    ax.set_xlabel("measured ms / step")
    ax.set_ylabel("estimated ms / step")
    ax.set_title("Planner estimate vs measured (2 hosts x 2 ranks)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, default=Path("rates.json"))
    c = sub.add_parser("check")
    c.add_argument("--rates", type=Path, required=True)
    c.add_argument("--steps", type=int, default=20)
    c.add_argument("--write-docs", type=Path)
    c.add_argument("--plot", type=Path)
    c.add_argument("--load", default="loaded machine (8 engineers)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "measure":
        measure_rates(args.out)
        return
    rates = Rates.load(args.rates)
    rows = check(rates, args.steps)
    if args.plot:
        scatter(rows, args.plot)
    text = report(rows, rates, args.load, args.plot)
    print(text)
    if args.write_docs:
        replace_section(args.write_docs, "## Cost model against measured steps", text)


if __name__ == "__main__":
    main()
