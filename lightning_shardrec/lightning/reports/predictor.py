"""``QuantizedPredictor``: run any quantized model under ``Trainer.predict``.

A model that is already a LightningModule (with ``forward(batch)``) needs no
wrapper: Lightning's default ``predict_step`` calls ``self(batch)``. This wraps a
plain ``nn.Module`` (e.g. the result of :func:`~lightning_shardrec.inference.load`
for a non-Lightning model) the same way::

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    scores = trainer.predict(QuantizedPredictor(model), datamodule=data)

This is the only file of ``inference`` that imports Lightning.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import Tensor, nn


class QuantizedPredictor(L.LightningModule):
    """``predict_step(batch) = model(batch)``, optionally squashed by ``sigmoid`` (click probabilities)."""

    def __init__(self, model: nn.Module, *, sigmoid: bool = False) -> None:
        super().__init__()
        self.model = model.eval()
        self.sigmoid = sigmoid

    def forward(self, batch: Any) -> Tensor:
        out = self.model(batch)
        return out.sigmoid() if self.sigmoid else out

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self(batch)
