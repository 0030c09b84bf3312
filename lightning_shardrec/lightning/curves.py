"""Training curves: a callback that records loss, AUROC and NE and draws them as a PNG.

``TrainingCurves`` keeps, on rank 0, every training step's ``train_{loss,auroc,ne}_step``
and every validation's ``val_{loss,auroc,ne}``; at the end of ``fit`` it writes
``curves.png`` (in the logger's directory unless ``path`` is given) and prints the
last validation figures. Drawing needs matplotlib (imported only then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

PANELS = ("loss", "auroc", "ne")


@dataclass
class CurveHistory:
    """``train[name]`` and ``val[name]``: lists of ``(global_step, value)`` per panel name."""

    train: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: {p: [] for p in PANELS})
    val: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: {p: [] for p in PANELS})


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_curves(history: CurveHistory, path: str | Path, title: str = "training curves") -> Path:
    """Draw one panel per name in :data:`PANELS` (train per step, smoothed; val as dots) into ``path``."""
    from matplotlib.figure import Figure  # object API: no pyplot, no GUI backend

    fig = Figure(figsize=(4 * len(PANELS), 3.2), layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for ax, name in zip(axes, PANELS, strict=True):
        train, val = history.train[name], history.val[name]
        if train:
            steps, values = zip(*train, strict=True)
            ax.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=0.8)
            ax.plot(steps, _smooth(list(values), max(1, len(values) // 20)), color="tab:blue", label="train")
        if val:
            steps, values = zip(*val, strict=True)
            ax.plot(steps, values, "o-", color="tab:orange", label="val")
        ax.set_title(name.upper() if name != "loss" else "BCE loss")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if train or val:
            ax.legend()
    fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


class TrainingCurves(Callback):
    """Record ``{train,val}_{loss,auroc,ne}`` and write them as a PNG at the end of ``fit``.

    Args:
        path: where the PNG goes; default ``<log_dir>/curves.png``.
        enabled: ``False`` records and draws nothing.
    """

    def __init__(self, path: str | None = None, enabled: bool = True) -> None:
        self.path, self.enabled = path, enabled
        self.history = CurveHistory()
        self.written: Path | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not (self.enabled and trainer.is_global_zero):
            return
        metrics = trainer.callback_metrics
        for name in PANELS:
            value = metrics.get(f"train_{name}_step")
            if value is not None:
                self.history.train[name].append((trainer.global_step, float(value)))

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.enabled and trainer.is_global_zero) or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        for name in PANELS:
            value = metrics.get(f"val_{name}")
            if value is not None:
                self.history.val[name].append((trainer.global_step, float(value)))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        log_dir = trainer.log_dir  # a collective: every rank asks
        if not trainer.is_global_zero:
            return
        last = {name: values[-1][1] for name, values in self.history.val.items() if values}
        if last:
            print("final validation: " + ", ".join(f"val_{k}={v:.4f}" for k, v in last.items()), flush=True)
        path = self.path or Path(log_dir or trainer.default_root_dir) / "curves.png"
        title = f"{type(pl_module).__name__}, {trainer.world_size} rank(s)"
        self.written = plot_curves(self.history, path, title=title)
        print(f"training curves: {self.written}", flush=True)
