"""The strategy through Lightning on one device: exact against no strategy (32, 16-mixed, bf16-mixed,
the pipeline on and off), and a DLRM step through Lightning next to the same step as a plain loop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec import (
    DistributedModelParallel,
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    ShardRecStrategy,
)
from lightning_shardrec.data import RecBatch
from lightning_shardrec.data.datamodule import SyntheticRecDataModule
from lightning_shardrec.gpu_check.env import Mode, one_rank_group
from lightning_shardrec.gpu_check.report import Check, Report, Status
from lightning_shardrec.models.dlrm import DLRM
from lightning_shardrec.planner import (
    ComputeDevice,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingType,
    Topology,
)

PRECISIONS = ("32", "16-mixed", "bf16-mixed")
TOL = {"32": {"rtol": 1e-4, "atol": 1e-5}, "mixed": {"rtol": 1e-3, "atol": 1e-4}}
NUM_DENSE = 13


class StepModule(L.LightningModule):
    """A DLRM trained on binary cross-entropy; nothing else per step (no metrics, no logging)."""

    def __init__(self, tables: list[EmbeddingBagConfig], lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        dim = tables[0].embedding_dim
        self.model = DLRM(EmbeddingBagCollection(tables), NUM_DENSE, [32, dim], [32, 1])
        self.lr = lr

    def forward(self, batch: RecBatch) -> Tensor:
        return self.model(batch.dense, batch.sparse).squeeze(1)

    def training_step(self, batch: RecBatch, batch_idx: int) -> Tensor:
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.lr, eps=1e-8)


def tables(n: int, rows: int, dim: int, dynamic: bool = False) -> list[EmbeddingBagConfig]:
    dyn = DynamicConfig() if dynamic else None
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"], dynamic=dyn)
        for i in range(n)
    ]


def data(specs: list[EmbeddingBagConfig], batch: int, steps: int) -> SyntheticRecDataModule:
    feats = [{"name": t.feature_names[0], "num_embeddings": t.num_embeddings} for t in specs]
    return SyntheticRecDataModule(num_dense=NUM_DENSE, tables=feats, batch_size=batch, num_batches=steps, val_batches=0)


def table_wise(specs: list[EmbeddingBagConfig]) -> dict[str, ParameterConstraints]:
    """Every table fused (tiny tables would go data-parallel)."""
    return {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE]) for t in specs}


def trainer(mode: Mode, precision: str, strategy: Any, steps: int, callbacks: list[Any] | None = None) -> L.Trainer:
    options: dict[str, Any] = {"precision": precision}
    if precision == "16-mixed" and not mode.cuda:  # Trainer would turn it into bf16 on CPU: the plugin keeps fp16
        from lightning.pytorch.plugins.precision import MixedPrecision

        options = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return L.Trainer(
        accelerator="gpu" if mode.cuda else "cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **options,
    )


def _fit(mode: Mode, precision: str, sharded: bool, pipeline: bool = False) -> dict[str, Tensor]:
    s = mode.sizes
    specs = tables(3, 40, 8)
    model = StepModule(specs)
    strategy = ShardRecStrategy(kernel="torch", constraints=table_wise(specs), pipeline=pipeline) if sharded else "auto"
    trainer(mode, precision, strategy, s.exact_steps).fit(model, datamodule=data(specs, s.exact_batch, s.exact_steps))
    state = strategy.full_state_dict() if isinstance(strategy, ShardRecStrategy) else model.state_dict()
    return {k: v.detach().float().cpu() for k, v in state.items() if isinstance(v, Tensor)}


def check_strategy(report: Report, mode: Mode) -> None:
    """``strategy="shardrec"`` at ``devices=1`` vs no strategy, per precision; the pipeline on vs off."""
    for precision in PRECISIONS:
        want = _fit(mode, precision, sharded=False)
        got = _fit(mode, precision, sharded=True)
        _compare_states(
            report, f"strategy vs none, {precision}", got, want, TOL["32" if precision == "32" else "mixed"]
        )
    _compare_states(report, "pipeline on vs off, 32", _fit(mode, "32", True, True), _fit(mode, "32", True), TOL["32"])


def _compare_states(report: Report, name: str, got: dict[str, Tensor], want: dict[str, Tensor], tol: dict) -> None:
    missing = sorted(set(want) ^ set(got))
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in want if k in got and got[k].shape == want[k].shape}
    bad = [k for k in diffs if not torch.allclose(got[k], want[k], **tol)] + missing
    worst = max(diffs.values(), default=float("nan"))
    detail = f"max |diff| {worst:.2e} over {len(diffs)} tensors (rtol {tol['rtol']}, atol {tol['atol']})"
    if bad:
        detail += f"; outside or unmatched: {', '.join(bad[:4])}"
    report.add(Check("exactness", name, Status.FAIL if bad else Status.PASS, detail, {"max_abs_diff": worst}))


class _StepClock(L.Callback):
    """Wall time between consecutive batch ends (the whole step: data, hooks, forward, backward, optimizer)."""

    def __init__(self, mode: Mode) -> None:
        self.mode, self.ends = mode, []  # type: ignore[var-annotated]

    def on_train_batch_end(self, *args: Any) -> None:
        self.mode.sync()
        self.ends.append(time.perf_counter())


def _median_interval(ends: list[float], warmup: int) -> float:
    gaps = sorted(b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False))
    return gaps[len(gaps) // 2]


def step_batches(mode: Mode, specs: list[EmbeddingBagConfig]) -> list[RecBatch]:
    """The timed steps' batches, made once and already on the device (so the clocks time training, not data)."""
    s = mode.sizes
    dm = data(specs, s.step_batch, s.warmup + s.steps + 1)
    dm.setup("fit")
    return [b.to(mode.device) for b in dm.train_dataloader()]


class _Replay:
    def __init__(self, batches: list[RecBatch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[RecBatch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def lightning_step_seconds(mode: Mode, specs: list[EmbeddingBagConfig], batches: list[RecBatch]) -> float:
    clock = _StepClock(mode)
    strategy = ShardRecStrategy(kernel="torch", constraints=table_wise(specs))
    replay = _Replay(batches)  # one loader (a plain list would read as a list of loaders)
    trainer(mode, "32", strategy, len(batches), [clock]).fit(StepModule(specs), train_dataloaders=replay)
    return _median_interval(clock.ends, mode.sizes.warmup)


def plain_loop(mode: Mode, specs: list[EmbeddingBagConfig]) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The same model for a plain loop: ``(dmp, dense optimizer)`` (inside :func:`one_rank_group`)."""
    s = mode.sizes
    module = StepModule(specs)
    planner = EmbeddingShardingPlanner(
        Topology(1, compute_device=ComputeDevice(mode.device.type)),
        batch_size=s.step_batch,
        constraints=table_wise(specs),
    )
    dmp = DistributedModelParallel(
        module, device=mode.device, planner=planner, kernel="torch", embedding_optimizer="adagrad"
    )
    return dmp, torch.optim.Adagrad(dmp.dense_parameters(), lr=module.lr, eps=1e-8)


def train_step(dmp: nn.Module, opt: torch.optim.Optimizer, batch: RecBatch) -> None:
    loss = F.binary_cross_entropy_with_logits(dmp(batch), batch.labels)
    loss.backward()
    opt.step()
    opt.zero_grad()


def plain_step_seconds(mode: Mode, specs: list[EmbeddingBagConfig], batches: list[RecBatch]) -> float:
    ends = []
    with one_rank_group(mode):
        dmp, opt = plain_loop(mode, specs)
        for batch in batches:
            train_step(dmp, opt, batch)
            mode.sync()
            ends.append(time.perf_counter())
    return _median_interval(ends, mode.sizes.warmup)


def check_lightning_overhead(report: Report, mode: Mode) -> None:
    s = mode.sizes
    specs = tables(s.step_tables, s.step_rows, s.step_dim)
    batches = step_batches(mode, specs)
    light, plain = lightning_step_seconds(mode, specs, batches), plain_step_seconds(mode, specs, batches)
    report.add(
        Check(
            "speed",
            "DLRM step: Lightning vs plain loop",
            Status.INFO,
            f"{light * 1e3:.2f} ms vs {plain * 1e3:.2f} ms per step of {s.step_batch} samples "
            f"(Lightning's overhead {100 * (light / plain - 1):+.0f}%)",
            {
                "lightning_s": light,
                "plain_s": plain,
                "batch": s.step_batch,
                "tables": s.step_tables,
                "rows": s.step_rows,
                "dim": s.step_dim,
            },
        )
    )
