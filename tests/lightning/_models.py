"""A small recommender LightningModule and helpers shared by the strategy tests."""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType, SyntheticRecDataModule

TABLES = [("big", 120, 8, PoolingType.SUM), ("mid", 30, 12, PoolingType.MEAN), ("tiny", 3, 4, PoolingType.SUM)]


class Rec(L.LightningModule):
    def __init__(
        self,
        optimizer: str = "adagrad",
        lr: float = 0.05,
        scheduler: bool = False,
        manual: bool = False,
        bad_id_at: int | None = None,
        late: bool = False,
    ) -> None:
        super().__init__()
        if not late:  # late: LateRec builds in configure_model
            self.build()
        self.optimizer, self.lr, self.scheduler = optimizer, lr, scheduler
        self.automatic_optimization = not manual
        self.bad_id_at = bad_id_at  # step at which rank 1 feeds an out-of-range id

    def build(self) -> None:
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t_{f}", feature_names=[f], pooling=p)
                for f, n, d, p in TABLES
            ]
        )
        self.mlp = torch.nn.Linear(3 + sum(d for _, _, d, _ in TABLES), 1)

    def forward(self, batch):
        x = torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)
        return self.mlp(x).squeeze(1)

    def training_step(self, batch, i):
        if self.bad_id_at == i and self.global_rank == 1:
            batch.sparse.values()[0] = 10**6
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.log("loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            if self.scheduler:
                self.lr_schedulers().step()
        return loss

    def validation_step(self, batch, i):
        self.log("val_loss", F.binary_cross_entropy_with_logits(self(batch), batch.labels), sync_dist=True)

    def predict_step(self, batch, i):
        return self(batch)

    def configure_optimizers(self):
        cls = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[self.optimizer]
        opt = cls(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LateRec(Rec):
    """Rec with its layers built in ``configure_model`` (under the strategy's ``tensor_init_context``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(late=True, **kwargs)

    def configure_model(self) -> None:
        if not hasattr(self, "mlp"):
            self.build()


def data(batch_size: int, num_batches: int, seed: int = 1, val_batches: int = 0) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=3,
        tables=[{"name": f, "num_embeddings": n} for f, n, _, _ in TABLES],
        batch_size=batch_size,
        num_batches=num_batches,
        val_batches=val_batches,
        pooling_factor=3.0,
        seed=seed,
    )


def trainer(**kwargs) -> L.Trainer:
    base = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    base.update(kwargs)
    return L.Trainer(**base)


def external_launch(rank: int, world: int) -> None:
    """Tell Lightning the processes exist already (as torchrun would)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
    )
