"""Deferred table updates (issue 31): accumulation / norm clipping vs the fused in-backward update, 2 CPU ranks.

    python benchmarks/deferred_bench.py [--rows 100000,10000] [--batch 1024] [--steps 24]
        [--repeats 3] [--quick] [--write-docs docs/benchmarks.md]

Workload: the pipeline benchmark's DLRM shape (8 tables, dim 64: 4 x ``rows[0]`` row-wise and
4 x ``rows[1]`` table-wise; bottom MLP 13->128->64, top MLP 576->256->1; Adagrad lr 0.05),
``ShardRecStrategy(embedding_optimizer="rowwise_adagrad")``; batches built before ``fit``; one
thread per rank. Variants, alternating in the same processes each repeat:

* in backward, ``kernel="auto"`` and ``kernel="torch"`` (what a fit without accumulation or norm
  clipping runs; deferred updates run on the torch kernel, so that is the like-for-like baseline);
* ``gradient_clip_val=1.0`` (norm, k=1) and ``accumulate_grad_batches=4``: deferred.

Figures: samples/s over the timed micro-batches (median of repeats, min-max), and per rank the
peak bytes the deferred window holds (its unique rows x dim fp32 + row ids), beside the
bytes of that rank's tables. ``--write-docs`` replaces only ``## Deferred table updates``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SECTION = "## Deferred table updates (accumulation, norm clipping)"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_dlrm import BenchDLRM, StepClock, join_as_rank  # noqa: E402
from harness import cpu_model, ratios, replace_section  # noqa: E402

VARIANTS = {
    "in backward, kernel=auto": ({"kernel": "auto"}, {}),
    "in backward, kernel=torch": ({"kernel": "torch"}, {}),
    "deferred: gradient_clip_val=1.0 (norm), k=1": ({"kernel": "auto"}, {"gradient_clip_val": 1.0}),
    "deferred: accumulate_grad_batches=4": ({"kernel": "auto"}, {"accumulate_grad_batches": 4}),
}


def _identity(x: Any) -> Any:
    return x


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.data.synthetic import SyntheticRecDataset, SyntheticRecGenerator
    from lightning_shardrec.optim import DeferredTableUpdates

    tables, spec = join_as_rank(rank, world, cfg["rows"])
    big = cfg["rows"][0]
    steps = cfg["warmup"] + cfg["steps"]
    ds = SyntheticRecDataset(
        spec, batch_size=cfg["batch"], num_batches=steps, rank=rank, world_size=world,
        generator=SyntheticRecGenerator(spec),
    )  # fmt: skip
    batches = [ds.batch(i) for i in range(steps)]

    peak = {"bytes": 0}
    keep = DeferredTableUpdates.keep

    def keep_and_measure(self: DeferredTableUpdates, *args: Any) -> None:
        keep(self, *args)
        peak["bytes"] = max(peak["bytes"], self.kept_bytes())

    DeferredTableUpdates.keep = keep_and_measure  # type: ignore[method-assign]
    out: dict[str, list[float]] = {}
    for _ in range(cfg["repeats"]):
        for name in cfg["variants"]:
            options, trainer_options = VARIANTS[name]
            kinds = {f"t_{n}": ["row_wise" if r == big else "table_wise"] for n, r in tables}
            strategy = ShardRecStrategy(
                constraints={t: ParameterConstraints(sharding_types=k) for t, k in kinds.items()},
                embedding_optimizer="rowwise_adagrad",
                **options,
            )
            marks = StepClock()
            trainer = L.Trainer(
                accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, callbacks=[marks], **trainer_options,
            )  # fmt: skip
            peak["bytes"] = 0
            trainer.fit(BenchDLRM(tables), train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=_identity))
            t = marks.marks[cfg["warmup"] :]
            out.setdefault(name, []).append(cfg["batch"] * world * (len(t) - 1) / (t[-1] - t[0]))
            out.setdefault(f"{name} peak", []).append(peak["bytes"])
            weights = [w for s in strategy.sharded.values() for k in s.kernels() for w in k.split_weights()]
            out["table bytes"] = [sum(w.numel() * w.element_size() for w in weights)]
    return out


def kernel_times(cfg: dict[str, Any]) -> dict[str, list[float]]:
    """One process, no communication: the fused lookup + backward + update of the 4 big tables, ms per
    micro-batch, for the three ways (interleaved; the global batch's ids, as a row-wise owner sees them)."""
    import torch

    from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
    from lightning_shardrec.data.synthetic import SyntheticRecDataset, SyntheticRecGenerator, SyntheticSpec, to_features
    from lightning_shardrec.kernels import TableSpec, make_kernel
    from lightning_shardrec.optim import DeferredTableUpdates

    torch.set_num_threads(1)
    rows, batch = cfg["rows"][0], 2 * cfg["batch"]
    names = [f"f{i}" for i in range(4)]
    spec = SyntheticSpec(features=to_features([{"name": n, "num_embeddings": rows} for n in names]), num_dense=13)
    ds = SyntheticRecDataset(spec, batch_size=batch, num_batches=8, generator=SyntheticRecGenerator(spec))
    kjts = [ds.batch(i).sparse for i in range(8)]
    kjts = [KeyedJaggedTensor(k.keys(), k.values(), None, k.lengths()) for k in kjts]
    specs = [TableSpec(name=n, num_embeddings=rows, embedding_dim=64) for n in names]
    config = FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.01)
    grad = torch.randn(batch, 4 * 64)

    def kernel() -> Any:
        return make_kernel(specs, [0, 1, 2, 3], config, pooled=True, device="cpu", kernel="torch")

    plain, clipped, accumulated = kernel(), kernel(), kernel()
    clip_updates, acc_updates = DeferredTableUpdates([clipped]), DeferredTableUpdates([accumulated])

    def in_backward(kjt: Any, last: bool) -> None:
        plain(kjt).backward(grad)

    def norm_clip(kjt: Any, last: bool) -> None:
        clipped(kjt).backward(grad)
        norm = clip_updates.sum_squares().sqrt()
        clip_updates.scale_(torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        clip_updates.apply()

    def accumulate(kjt: Any, last: bool) -> None:
        accumulated(kjt).backward(grad)
        if last:
            acc_updates.apply()

    ways = {"in backward": in_backward, "deferred, norm clip, k=1": norm_clip, "deferred, k=4": accumulate}
    out: dict[str, list[float]] = {name: [] for name in ways}
    for window in range(cfg["kernel_iters"] + 1):  # the first window warms up
        order = list(ways)[window % 3 :] + list(ways)[: window % 3]  # rotate: no variant always runs first
        for name in order:
            start = time.perf_counter()
            for i in range(4):
                ways[name](kjts[(4 * window + i) % len(kjts)], i == 3)
            if window:
                out[name].append(1e3 * (time.perf_counter() - start) / 4)
    return out


def kernel_report(times: dict[str, list[float]]) -> list[str]:
    base = statistics.median(times["in backward"])
    lines = [
        "Kernel alone (one process, no communication; lookup + backward + update of the 4 big tables over the "
        "global batch's ids; windows of 4 micro-batches, the three ways in rotating order; median ms per "
        "micro-batch):",
        "",
        "| variant | ms per micro-batch | vs in backward |",
        "|---|---|---|",
    ]
    for name, values in times.items():
        med = statistics.median(values)
        lines.append(f"| {name} | {med:.1f} | {med / base:.2f}x |")
    return lines + [""]


def report(results: list[dict[str, list[float]]], cfg: dict[str, Any], command: str) -> str:
    def med(key: str) -> tuple[float, float, float]:
        per_repeat = [statistics.mean(r[key][i] for r in results) for i in range(cfg["repeats"])]
        return statistics.median(per_repeat), min(per_repeat), max(per_repeat)

    base_name = "in backward, kernel=torch"

    def paired(name: str) -> tuple[float, float, float]:
        """Per repeat, this variant's samples/s over the baseline's of the same repeat (both ranks' mean)."""
        if base_name not in cfg["variants"]:
            return (float("nan"),) * 3
        mean = [[statistics.mean(r[k][i] for r in results) for i in range(cfg["repeats"])] for k in (name, base_name)]
        st = ratios(*mean)
        return st.median, st.lo, st.hi

    big, small = cfg["rows"]
    lines = [
        SECTION,
        "",
        f"`{command}` — {cpu_model()}, {os.cpu_count()} cores, loaded machine (8 engineers sharing it), "
        f"{datetime.date.today().isoformat()}, 2 ranks (gloo, CPU, 1 thread each).",
        "",
        f"Workload: 4 x {big:,} rows row-wise + 4 x {small:,} table-wise, dim 64, rowwise_adagrad, batch "
        f"{cfg['batch']} per rank, {cfg['steps']} timed micro-batches after {cfg['warmup']} warm-up, median of "
        f"{cfg['repeats']} repeats (min-max).",
        "",
        "| variant | samples/s | vs in backward (torch kernel), paired per repeat | peak kept window per rank, MiB |",
        "|---|---|---|---|",
    ]
    for name in cfg["variants"]:
        sps, ratio = med(name), paired(name)
        kept = max(max(r[f"{name} peak"]) for r in results) / 2**20
        lines.append(
            f"| {name} | {sps[0]:,.0f} ({sps[1]:,.0f}-{sps[2]:,.0f}) | {ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f}) "
            f"| {kept:.1f} |"
        )
    tables = ", ".join(f"{r['table bytes'][0] / 2**20:.0f}" for r in results)
    lines += ["", f"Tables held per rank (MiB): {tables}.", ""]
    if cfg.get("kernel"):
        lines += kernel_report(cfg["kernel"])
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="100000,10000", help="rows of the 4 big and the 4 small tables")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel-iters", type=int, default=12, help="kernel-alone windows of 4 micro-batches")
    p.add_argument("--kernel-only", action="store_true", help="only the kernel-alone comparison (no Trainer)")
    p.add_argument("--variants", default="", help="comma-separated variant numbers (1-4) to run; default all")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--write-docs", type=Path, default=None)
    a = p.parse_args()
    cfg = {"rows": [int(x) for x in a.rows.split(",")], "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
           "repeats": a.repeats}  # fmt: skip
    cfg["kernel_iters"] = a.kernel_iters
    if a.quick:
        cfg.update(rows=[2000, 200], batch=64, steps=8, warmup=4, repeats=1, kernel_iters=2)
    names = list(VARIANTS)
    cfg["variants"] = [names[int(i) - 1] for i in a.variants.split(",")] if a.variants else names
    from lightning_shardrec.testing import run_ranks

    cfg["kernel"] = kernel_times(cfg)
    if a.kernel_only:
        print("\n".join(kernel_report(cfg["kernel"])))
        return
    results = run_ranks(run_rank, 2, cfg, timeout=1800)
    command = "python benchmarks/deferred_bench.py " + " ".join(sys.argv[1:])
    text = report(results, cfg, command.strip())
    print(text)
    if a.write_docs is not None:
        replace_section(a.write_docs, SECTION, text)


if __name__ == "__main__":
    main()
