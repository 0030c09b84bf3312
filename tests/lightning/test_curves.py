"""TrainingCurves: which logged names it reads, and panels with nothing logged left out with a note."""

from __future__ import annotations

import struct
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_shardrec.lightning.reports.curves import CurveHistory, TrainingCurves, plot_curves

STEPS_PER_EPOCH = 4


class Logs(L.LightningModule):
    """A linear model that logs its loss the way ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)
        self.how = how

    def training_step(self, batch, i):
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self.lin(x).squeeze(1), y)
        if self.how == "train_loss":
            self.log("train_loss", loss)  # on_step=True by default in training_step
        elif self.how == "step_and_epoch":
            self.log("train_loss", loss, on_step=True, on_epoch=True)  # train_loss_step, train_loss_epoch
        elif self.how == "epoch_only":
            self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", F.binary_cross_entropy_with_logits(self.lin(x).squeeze(1), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH, 3, generator=g)
    y = (x[:, 0] > 0).float()
    return torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=8)


def _fit(how: str, tmp_path: Path, epochs: int = 1) -> TrainingCurves:
    curves = TrainingCurves(path=str(tmp_path / "curves.png"))
    L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[curves], num_sanity_val_steps=0,
    ).fit(Logs(how), _loader(), _loader())
    return curves


def _png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_reads_a_plain_train_loss_and_leaves_out_empty_panels(tmp_path, capsys):
    curves = _fit("train_loss", tmp_path)
    train = curves.history.train["loss"]
    assert [s for s, _ in train] == list(range(1, STEPS_PER_EPOCH + 1))
    assert len({v for _, v in train}) == STEPS_PER_EPOCH  # one fresh value per step
    assert len(curves.history.val["loss"]) == 1
    assert curves.history.train["auroc"] == curves.history.train["ne"] == []
    out = capsys.readouterr().out
    assert "not drawn (nothing logged): AUROC, NE; log train_auroc/val_auroc, train_ne/val_ne to draw them" in out
    assert curves.written is not None and _png_width(curves.written) == 400  # one panel of 4 inches at 100 dpi


def test_reads_the_step_half_of_an_epoch_and_step_log(tmp_path):
    curves = _fit("step_and_epoch", tmp_path)
    assert len(curves.history.train["loss"]) == STEPS_PER_EPOCH


def test_an_epoch_only_value_is_recorded_once_not_every_step(tmp_path):
    curves = _fit("epoch_only", tmp_path, epochs=3)
    values = [v for _, v in curves.history.train["loss"]]
    assert len(values) == 2  # epochs 1 and 2, each seen once in the next epoch (epoch 3's comes after the last step)
    assert values[0] != values[1]


@pytest.mark.parametrize("filled", [(), ("loss", "auroc", "ne")])
def test_plot_draws_only_panels_with_values(tmp_path, filled):
    history = CurveHistory()
    for name in filled:
        history.train[name] = [(1, 0.5), (2, 0.4)]
    out = plot_curves(history, tmp_path / "c.png")
    assert _png_width(out) == 400 * max(1, len(filled))
