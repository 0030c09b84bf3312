"""A small recommender for the inference tests (top level: export records it by import path)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shardrec import (
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    PoolingType,
    SyntheticRecDataModule,
)

FEATURES = [("user", 200, PoolingType.SUM), ("item", 60, PoolingType.MEAN), ("ctx", 10, PoolingType.SUM)]
NUM_DENSE = 3


class TinyRec(L.LightningModule):
    def __init__(self, dim: int = 8, weighted: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(num_embeddings=n, embedding_dim=dim * (1 + i % 2), name=f"t_{f}",
                                feature_names=[f], pooling=p) for i, (f, n, p) in enumerate(FEATURES)],
            is_weighted=weighted,
        )
        total = sum(dim * (1 + i % 2) for i in range(len(FEATURES)))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(NUM_DENSE + total, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, batch):
        return self.mlp(torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)).squeeze(1)

    def training_step(self, batch, i):
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)


def data(num_batches: int = 4, test_batches: int = 2, weighted: bool = False) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=NUM_DENSE,
        tables=[{"name": f, "num_embeddings": n} for f, n, _ in FEATURES],
        batch_size=64, num_batches=num_batches, val_batches=0, test_batches=test_batches,
        pooling_factor=4.0, weighted=weighted, seed=3,
    )


def trainer(**kwargs) -> L.Trainer:
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)
    base.update(kwargs)
    return L.Trainer(**base)


class DynRec(L.LightningModule):
    """TinyRec whose 'user' table is dynamic: ``capacity`` slots for its 200 ids (rows get evicted)."""

    forward, training_step, configure_optimizers = TinyRec.forward, TinyRec.training_step, TinyRec.configure_optimizers

    def __init__(self, dim: int = 8, capacity: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        tables = [EmbeddingBagConfig(num_embeddings=n, embedding_dim=dim, name=f"t_{f}", feature_names=[f], pooling=p)
                  for f, n, p in FEATURES]
        tables[0] = EmbeddingBagConfig(num_embeddings=capacity, embedding_dim=dim, name="t_user",
                                       feature_names=["user"], dynamic=DynamicConfig(eviction="lru", ttl_steps=3))
        self.ebc = EmbeddingBagCollection(tables)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(NUM_DENSE + dim * len(FEATURES), 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))


class SeqRec(torch.nn.Module):
    """A sequence model: an ``EmbeddingCollection`` read per id, summed per bag, then a linear head ``[B, 1]``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        from lightning_shardrec import EmbeddingCollection, EmbeddingConfig

        self.ec = EmbeddingCollection(
            [EmbeddingConfig(num_embeddings=50, embedding_dim=dim, name="t_hist", feature_names=["clicks", "views"]),
             EmbeddingConfig(num_embeddings=20, embedding_dim=dim, name="t_q", feature_names=["query"])]
        )  # fmt: skip
        self.head = torch.nn.Linear(3 * dim, 1)

    def forward(self, kjt):  # type: ignore[no-untyped-def]
        seqs = self.ec(kjt)
        pooled = [seqs[f].to_padded_dense(4).sum(1) for f in ("clicks", "views", "query")]  # [B, dim] each
        return self.head(torch.cat(pooled, dim=1))
