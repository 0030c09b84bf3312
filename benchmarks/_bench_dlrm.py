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


def join_as_rank(rank: int, world: int, rows: tuple[int, int]) -> tuple[list[tuple[str, int]], Any]:
    """Set this process up as rank ``rank`` of ``world`` on this host (one thread, Lightning's environment
    variables) and return the 8 ``(feature, rows)`` tables (4 of ``rows[0]``, 4 of ``rows[1]``) and their
    synthetic spec (13 dense features)."""
    import os

    from lightning_shardrec.data.synthetic import SyntheticSpec, to_features

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    big, small = rows
    tables = [(f"f{i}", big if i < 4 else small) for i in range(8)]
    return tables, SyntheticSpec(
        features=to_features([{"name": n, "num_embeddings": r} for n, r in tables]), num_dense=13
    )
