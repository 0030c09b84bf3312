"""Resident memory of a rank, measured from outside (``/proc/self/status``), and a model whose
tables dominate it: what the memory tests through the Trainer share."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

MiB = 2**20
DIM = 16
BATCH, BAG = 8, 2  # per rank: tiny batches, so the tables dominate every figure


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    """Resident bytes now, after freeing what Python and glibc hold on to (freed heap is handed back)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status("VmRSS")


def reset_peak() -> None:
    """The peak (``VmHWM``) restarts from the current resident size."""
    rss()
    Path("/proc/self/clear_refs").write_text("5")


def peak() -> int:
    return _status("VmHWM")


def held_bytes(strategy) -> int:
    """Bytes of this rank's table shards and their fused optimizer state (views into the kernels' buffers)."""
    total = 0
    for coll in strategy.sharded.values():
        total += sum(w.numel() * w.element_size() for shards in coll.local_shards().values() for _, w in shards)
        for states in coll.local_states().values():
            total += sum(t.numel() * t.element_size() for _, state in states for t in state.values())
    return total


class Big(L.LightningModule):
    """``tables`` tables of ``rows x 16`` fp32 in a library EmbeddingBagCollection (``plain``: nn.EmbeddingBag
    modules), an Adagrad over everything; batches are ``[B, tables, BAG]`` id tensors."""

    def __init__(self, rows: int, tables: int = 2, plain: bool = False, lr: float = 0.05) -> None:
        super().__init__()
        self.rows, self.tables, self.plain, self.lr = rows, tables, plain, lr
        torch.manual_seed(0)
        if plain:
            self.bags = nn.ModuleList(nn.EmbeddingBag(rows, DIM, mode="sum") for _ in range(tables))
        else:
            configs = [
                EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"])
                for i in range(tables)
            ]
            self.ebc = EmbeddingBagCollection(configs)
        self.top = nn.Linear(DIM * tables, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.plain:
            pooled = torch.cat([bag(ids[:, i]) for i, bag in enumerate(self.bags)], 1)
        else:
            values = ids.transpose(0, 1).reshape(-1)
            lengths = torch.full((self.tables * ids.shape[0],), BAG, dtype=torch.long)
            kjt = KeyedJaggedTensor([f"f{i}" for i in range(self.tables)], values, lengths=lengths)
            pooled = self.ebc(kjt).values()
        return self.top(pooled).squeeze(1)

    def training_step(self, batch, i):
        ids, y = batch
        return F.binary_cross_entropy_with_logits(self(ids), y)

    def validation_step(self, batch, i):
        ids, y = batch
        self.log("val_loss", F.binary_cross_entropy_with_logits(self(ids), y), sync_dist=True)

    def predict_step(self, batch, i):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=self.lr)


def batches(rows: int, tables: int, steps: int, rank: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randint(0, rows, (BATCH, tables, BAG), generator=g), torch.rand(BATCH, generator=g).round())
        for _ in range(steps)
    ]
    return torch.utils.data.DataLoader(data, batch_size=None)
