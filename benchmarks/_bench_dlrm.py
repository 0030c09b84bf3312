"""The small Lightning DLRM and step clock the pipeline and deferred-update benchmarks train."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig


class BenchDLRM(L.LightningModule):
    """Tables ``[(feature, rows)]`` of dim 64 (8 of them: the top MLP takes 8 x 64 + 64), Adagrad."""

    def __init__(self, tables: list[tuple[str, int]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(num_embeddings=r, embedding_dim=64, name=f"t_{n}", feature_names=[n])
                for n, r in tables
            ]
        )
        self.bottom = nn.Sequential(nn.Linear(13, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(64 * (len(tables) + 1), 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x = torch.cat([self.bottom(batch.dense), self.ebc(batch.sparse).values()], 1)
        return F.binary_cross_entropy_with_logits(self.top(x).squeeze(1), batch.labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=0.05, eps=1e-8)


class StepClock(L.Callback):
    """``marks``: the time at each training batch's start and at the end of training."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.marks.append(time.perf_counter())
