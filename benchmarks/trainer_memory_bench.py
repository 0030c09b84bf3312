"""Memory a user can count on: each rank's resident memory per phase, through the Trainer (issue 29).

    python benchmarks/trainer_memory_bench.py [--rows 16000000] [--tables 2] [--steps 4] [--quick]
        [--write-docs docs/benchmarks.md] [--png docs/trainer_memory.png]

The published figures: ``--rows 25000000 --png docs/trainer_memory.png`` (about 7.6 GiB in all).

A LightningModule with ``--tables`` tables of ``rows x 16`` fp32 in an EmbeddingBagCollection
and ``torch.optim.Adagrad`` (fused Adagrad state as large as the tables), built under
``trainer.init_module()``, goes through ``Trainer(strategy="shardrec")`` on 2 ranks (build,
shard, first step, steady steps, ``save_checkpoint``), then resumes that checkpoint on 3
ranks (build, shard + resume, first step, steady, save). Per rank and phase: the peak
(``VmHWM``, restarted at every phase) and the current resident memory (``VmRSS`` after
``malloc_trim``), over the rank's baseline (a warmed-up process), next to its share
``(T + S) / W`` (T tables, S their optimizer state) and to what a replicated (DDP) rank
holds, ``T + S``. The planner's printed estimate (fullest rank + allowance) is compared
with the measured absolute peak. ``--write-docs`` replaces only the ``## Memory per phase
through the Trainer`` section.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_model, replace_section  # noqa: E402

SECTION = "## Memory per phase through the Trainer"
GIB, MIB = 2**30, 2**20
PHASES = ["build", "shard", "first step", "steady", "save"]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _rss() -> int:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status("VmRSS")


class Meter:
    """Per phase: (peak over base, current over base); the peak restarts at every phase."""

    def __init__(self) -> None:
        self.base = _rss()
        self.phases: dict[str, tuple[int, int]] = {}
        self._restart()

    def _restart(self) -> None:
        _rss()
        Path("/proc/self/clear_refs").write_text("5")

    def mark(self, phase: str) -> None:
        now = _rss()
        self.phases[phase] = (_status("VmHWM") - self.base, now - self.base)
        self._restart()


def _model(rows: int, tables: int) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    class Big(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            configs = [
                EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=16, feature_names=[f"f{i}"])
                for i in range(tables)
            ]
            self.ebc = EmbeddingBagCollection(configs)
            self.top = torch.nn.Linear(16 * tables, 1)

        def training_step(self, batch, i):
            ids, y = batch
            lengths = torch.full((tables * ids.shape[0],), 2, dtype=torch.long)
            kjt = KeyedJaggedTensor([f"f{i}" for i in range(tables)], ids.transpose(0, 1).reshape(-1), lengths=lengths)
            return F.binary_cross_entropy_with_logits(self.top(self.ebc(kjt).values()).squeeze(1), y)

        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.05)

    return Big


def run_rank(rank: int, world: int, rows: int, tables: int, steps: int, ckpt_in: str | None, ckpt_out: str) -> dict:
    import lightning as L
    import torch

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.planner.machine.memory import RANK_ALLOWANCE

    launched = {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": rank, "NODE_RANK": 0, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in launched.items()}, MASTER_ADDR="127.0.0.1")  # as torchrun would
    os.environ.setdefault("MASTER_PORT", "29500")
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randint(0, rows, (8, tables, 2), generator=g), torch.rand(8, generator=g).round()) for _ in range(8)
    ]
    data = torch.utils.data.DataLoader(batches, batch_size=None)

    def trainer(strategy: Any, max_steps: int, callbacks: list) -> L.Trainer:
        quiet = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
        common = {"accelerator": "cpu", "devices": world, "use_distributed_sampler": False, **quiet}  # own batches
        return L.Trainer(strategy=strategy, max_steps=max_steps, callbacks=callbacks, **common)

    warm = trainer(ShardRecStrategy(), 2, [])  # imports, Lightning's and gloo's first use: the baseline
    with warm.init_module():
        small = _model(1000, tables)()
    warm.fit(small, torch.utils.data.DataLoader([(ids % 1000, y) for ids, y in batches[:2]], batch_size=None))
    del warm, small

    meter = Meter()
    Big = _model(rows, tables)

    class Phases(L.Callback):
        def on_train_start(self, trainer, pl_module):
            meter.mark("shard" if ckpt_in is None else "shard + resume")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "first step" not in meter.phases:
                meter.mark("first step")

    rowwise = ParameterConstraints(sharding_types=["row_wise"])
    strategy = ShardRecStrategy(constraints={f"t{i}": rowwise for i in range(tables)})
    t = trainer(strategy, steps + (0 if ckpt_in is None else 1), [Phases()])
    with t.init_module():
        model = Big()
    meter.mark("build")
    t.fit(model, data, ckpt_path=ckpt_in)
    meter.mark("steady")
    t.save_checkpoint(ckpt_out)
    meter.mark("save")
    stats = strategy.plan.stats
    held = 0
    for coll in strategy.sharded.values():
        held += sum(w.numel() * w.element_size() for shards in coll.local_shards().values() for _, w in shards)
        for states in coll.local_states().values():
            held += sum(x.numel() * x.element_size() for _, s in states for x in s.values())
    abs_peak = meter.base + max(p for p, _ in meter.phases.values())
    return {
        "phases": meter.phases,
        "base": meter.base,
        "held": held,
        "estimate": stats.max_storage + RANK_ALLOWANCE,
        "estimate_tables": stats.max_storage,
        "abs_peak": abs_peak,
    }


def measure(rows: int, tables: int, steps: int) -> dict[str, Any]:
    from lightning_shardrec.testing import run_ranks

    root = Path(tempfile.mkdtemp(prefix="shardrec_memory_"))
    try:
        two = run_ranks(run_rank, 2, rows, tables, steps, None, str(root / "w2"), timeout=1800)
        three = run_ranks(run_rank, 3, rows, tables, steps, str(root / "w2"), str(root / "w3"), timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"2 ranks": two, "3 ranks (resumed from 2)": three}


def report(results: dict[str, Any], rows: int, tables: int, png: str | None) -> str:
    t_bytes = rows * 16 * 4 * tables
    total = 2 * t_bytes  # tables + Adagrad state
    lines = [
        SECTION,
        "",
        f"`python benchmarks/trainer_memory_bench.py --rows {rows} --tables {tables}` on {cpu_model()}, "
        f"loaded machine (8 engineers), {os.cpu_count()} cores. {tables} tables of {rows:,} x 16 fp32 "
        f"(T = {t_bytes / GIB:.2f} GiB) trained by Adagrad (state S = T): T + S = {total / GIB:.2f} GiB, what a "
        "replicated (DDP) rank holds. Built under `trainer.init_module()`, row-wise, through "
        '`Trainer(strategy="shardrec")`: 2 ranks build, shard, train, save; 3 ranks resume that checkpoint and '
        "save. Figures in GiB over each rank's baseline (a warmed-up process: interpreter, torch, Lightning, "
        "gloo), peak (`VmHWM`, restarted per phase) / current (`VmRSS`).",
        "",
        "| run | rank | share (T+S)/W | " + " | ".join(f"{p} peak / now" for p in PHASES) + " | max peak / share |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|",
    ]
    for name, ranks in results.items():
        for r, res in enumerate(ranks):
            ph = res["phases"]
            cells = []
            for p in PHASES:
                key = p if p in ph else "shard + resume" if p == "shard" else p
                peak, now = ph[key]
                cells.append(f"{peak / GIB:.2f} / {now / GIB:.2f}")
            top = max(v[0] for v in ph.values())
            lines.append(
                f"| {name} | {r} | {res['held'] / GIB:.2f} | " + " | ".join(cells) + f" | {top / res['held']:.2f} |"
            )
    lines += [
        "",
        "Planner estimate (fullest rank: tables, optimizer state, buffers + the allowance "
        "`planner.memory.RANK_ALLOWANCE`) against the measured absolute peak (baseline included):",
        "",
        "| run | estimate | of which allowance | measured peak (max over ranks) | baseline (max) |",
        "|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        est = ranks[0]["estimate"]
        lines.append(
            f"| {name} | {est / GIB:.2f} GiB | {(est - ranks[0]['estimate_tables']) / GIB:.2f} GiB | "
            f"{max(r['abs_peak'] for r in ranks) / GIB:.2f} GiB | {max(r['base'] for r in ranks) / GIB:.2f} GiB |"
        )
    if png:
        lines += ["", f"![per-rank peak and current memory per phase]({Path(png).name})"]
    return "\n".join(lines) + "\n"


def picture(results: dict[str, Any], rows: int, tables: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = 2 * rows * 16 * 4 * tables / GIB
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True)
    for ax, (name, ranks) in zip(axes, results.items(), strict=True):
        width = 0.8 / len(ranks)
        for r, res in enumerate(ranks):
            ph = res["phases"]
            keys = [p if p in ph else "shard + resume" for p in PHASES]
            xs = [i + (r - (len(ranks) - 1) / 2) * width for i in range(len(PHASES))]
            ax.bar(xs, [ph[k][0] / GIB for k in keys], width, label=f"rank {r} peak", alpha=0.85)
            ax.scatter(xs, [ph[k][1] / GIB for k in keys], marker="_", s=200, color="black")
        share = ranks[0]["held"] / GIB
        ax.axhline(share, linestyle="--", color="green", label=f"share (T+S)/W = {share:.2f} GiB")
        ax.axhline(total, linestyle=":", color="red", label=f"replicated (DDP) rank: T+S = {total:.2f} GiB")
        ax.set_xticks(range(len(PHASES)), ["build", "shard" if "2" in name[:1] else "shard+resume", *PHASES[2:]])
        ax.set_title(name)
        ax.set_ylabel("GiB over the rank's baseline (bars: peak, dash: now)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16_000_000)
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--write-docs", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--quick", action="store_true", help="100,000 rows, 2 steps: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.rows, args.steps = 100_000, 2
    results = measure(args.rows, args.tables, args.steps)
    if args.png:
        picture(results, args.rows, args.tables, args.png)
    text = report(results, args.rows, args.tables, args.png)
    print(text)
    if args.write_docs:
        replace_section(Path(args.write_docs), SECTION, text)


if __name__ == "__main__":
    main()
