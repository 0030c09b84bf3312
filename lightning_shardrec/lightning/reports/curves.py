"""Training curves: a callback that records loss, AUROC and NE and draws them as a PNG.

``TrainingCurves`` keeps, on rank 0, every training step's value of each panel's metric
and every validation's; at the end of ``fit`` it writes ``curves.png`` (in the logger's
directory unless ``path`` is given) and prints the last validation figures. Drawing needs
matplotlib (imported only then).

Names read (the first one logged wins; :data:`TRAIN_NAMES`, :data:`VAL_NAMES`)::

    train  train_{loss,auroc,ne}_step   self.log(..., on_step=True, on_epoch=True)
           train_{loss,auroc,ne}        self.log("train_loss", loss) in training_step
           loss_step, loss              (loss panel only)
    val    val_{loss,auroc,ne}, val_{loss,auroc,ne}_epoch

A panel with nothing logged is left out, and the figure's title names it and the names
that would draw it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

PANELS = ("loss", "auroc", "ne")
TRAIN_NAMES: dict[str, tuple[str, ...]] = {p: (f"train_{p}_step", f"train_{p}") for p in PANELS}
TRAIN_NAMES["loss"] = (*TRAIN_NAMES["loss"], "loss_step", "loss")
VAL_NAMES = {p: (f"val_{p}", f"val_{p}_epoch") for p in PANELS}


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
    """Draw one panel per name in :data:`PANELS` that has values (train per step, smoothed; val as
    dots) into ``path``; the title names the panels left out for want of values."""
    from matplotlib.figure import Figure  # object API: no pyplot, no GUI backend

    drawn = [p for p in PANELS if history.train[p] or history.val[p]]
    missing = [p for p in PANELS if p not in drawn]
    fig = Figure(figsize=(4 * max(1, len(drawn)), 3.2), layout="constrained")
    axes = fig.subplots(1, max(1, len(drawn)), squeeze=False)[0]
    for ax, name in zip(axes, drawn, strict=False):
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
        ax.legend()
    if not drawn:
        axes[0].set_axis_off()
        axes[0].text(0.5, 0.5, "nothing logged to draw", ha="center", va="center")
    fig.suptitle(title + (f"\n{missing_note(missing)}" if missing else ""))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def missing_note(missing: list[str]) -> str:
    """Which panels are left out and what to log to draw them."""
    names = ", ".join(f"{TRAIN_NAMES[p][1]}/{VAL_NAMES[p][0]}" for p in missing)
    return f"not drawn (nothing logged): {', '.join(p.upper() for p in missing)}; log {names} to draw them"


def _first(metrics: dict[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        if name in metrics:
            return name, metrics[name]
    return None


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
        self._seen: dict[str, Any] = {}  # name -> the value object last recorded (skips stale epoch values)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not (self.enabled and trainer.is_global_zero):
            return
        metrics = trainer.callback_metrics
        for name in PANELS:
            found = _first(metrics, TRAIN_NAMES[name])
            if found is None or self._seen.get(found[0]) is found[1]:
                continue  # not logged, or an epoch-level value already recorded
            self._seen[found[0]] = found[1]
            self.history.train[name].append((trainer.global_step, float(found[1])))

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.enabled and trainer.is_global_zero) or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        for name in PANELS:
            found = _first(metrics, VAL_NAMES[name])
            if found is not None:
                self.history.val[name].append((trainer.global_step, float(found[1])))

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
        missing = [p for p in PANELS if not (self.history.train[p] or self.history.val[p])]
        note = f" ({missing_note(missing)})" if missing else ""
        print(f"training curves: {self.written}{note}", flush=True)
