"""Bring your own recommender: an ordinary LightningModule, sharded by changing only the strategy.

``TwoTower`` below was written without this library in mind apart from its embedding
collection: a user tower and an item tower (pooled ``EmbeddingBagCollection`` lookups plus
an MLP each), scored by a dot product. It uses ``torch.optim.Adam``; the strategy takes
the tables out of it and trains them with the fused row-sparse Adam it derives.

    python examples/bring_your_own/train.py                      # plain Lightning, 1 process
    python examples/bring_your_own/train.py --strategy shardrec  # sharded tables, 2 processes
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import BinaryAUROC

import lightning_shardrec  # noqa: F401  (registers strategy="shardrec")
from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, SyntheticRecDataModule

USER_FEATURES = {"user_id": 20_000, "user_history": 50_000}
ITEM_FEATURES = {"item_id": 50_000, "item_category": 500}


class TwoTower(L.LightningModule):
    """``score = <user_tower(user ids, dense), item_tower(item ids)>``; BCE on clicks."""

    def __init__(self, dim: int = 16, num_dense: int = 4, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{f}", num_embeddings=n, embedding_dim=dim, feature_names=[f])
                for f, n in {**USER_FEATURES, **ITEM_FEATURES}.items()
            ]
        )
        self.user_tower = nn.Sequential(nn.Linear(2 * dim + num_dense, 32), nn.ReLU(), nn.Linear(32, dim))
        self.item_tower = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, dim))
        self.val_auroc = BinaryAUROC()

    def forward(self, batch) -> torch.Tensor:  # noqa: ANN001  (a RecBatch: dense, sparse, labels)
        pooled = self.ebc(batch.sparse)
        user = torch.cat([pooled[f] for f in USER_FEATURES] + [batch.dense], dim=1)
        item = torch.cat([pooled[f] for f in ITEM_FEATURES], dim=1)
        return (self.user_tower(user) * self.item_tower(item)).sum(1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:  # noqa: ANN001
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:  # noqa: ANN001
        logits = self(batch)
        self.val_auroc.update(logits.sigmoid(), batch.labels.long())
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, batch.labels), sync_dist=True)
        self.log("val_auroc", self.val_auroc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def datamodule(global_batch: int, devices: int, steps: int, val_batches: int) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=4,
        tables=[{"name": f, "num_embeddings": n} for f, n in {**USER_FEATURES, **ITEM_FEATURES}.items()],
        batch_size=global_batch // devices,
        num_batches=steps,
        val_batches=val_batches,
        pooling_factor=3.0,
    )


def main(argv: Sequence[str] | None = None, **trainer_kwargs: object) -> dict[str, float]:
    """Train and validate; returns the final ``callback_metrics`` as floats."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto", help="auto (plain Lightning) or shardrec")
    parser.add_argument("--devices", type=int, default=None, help="default: 2 with shardrec, else 1")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-batches", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=512)
    args = parser.parse_args(argv)
    devices = args.devices or (2 if args.strategy == "shardrec" else 1)
    torch.manual_seed(0)
    trainer = L.Trainer(
        **{
            "strategy": args.strategy,  # the only line that changes
            "accelerator": "cpu",
            "devices": devices,
            "max_steps": args.steps,
            "logger": False,
            "enable_checkpointing": False,
            "num_sanity_val_steps": 0,
            **trainer_kwargs,
        }
    )
    trainer.fit(TwoTower(), datamodule(args.global_batch, devices, args.steps, args.val_batches))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        auroc, loss = metrics.get("val_auroc", float("nan")), metrics.get("val_loss", float("nan"))
        print(f"val_auroc={auroc:.4f} val_loss={loss:.4f}")
    return metrics


if __name__ == "__main__":
    main()
