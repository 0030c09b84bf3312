"""The smallest end-to-end run: an ordinary LightningModule, sharded by one argument.

python examples/quickstart.py                  # strategy="shardrec", 2 CPU processes
python examples/quickstart.py --devices 1      # a world of one (same global batches)
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F

import lightning_shardrec  # noqa: F401  (registers strategy="shardrec")
from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, SyntheticRecDataModule


class Rec(L.LightningModule):
    """EBC + MLP; nothing here knows about sharding."""

    def __init__(self, num_dense: int = 4) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="user_table", embedding_dim=16, num_embeddings=50_000, feature_names=["user_hist"]
                ),
                EmbeddingBagConfig(name="item_table", embedding_dim=16, num_embeddings=20_000, feature_names=["item"]),
            ]
        )
        self.mlp = torch.nn.Sequential(torch.nn.Linear(num_dense + 32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, batch):
        x = torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)
        return self.mlp(x).squeeze(1)

    def training_step(self, batch, i):
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, i):
        self.log("val_loss", F.binary_cross_entropy_with_logits(self(batch), batch.labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = SyntheticRecDataModule(
        num_dense=4,
        tables=[{"name": "user_hist", "num_embeddings": 50_000}, {"name": "item", "num_embeddings": 20_000}],
        batch_size=args.global_batch // args.devices,
        num_batches=args.steps,
        val_batches=4,
    )
    trainer = L.Trainer(
        strategy="shardrec",
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Rec(), data)


if __name__ == "__main__":
    main()
