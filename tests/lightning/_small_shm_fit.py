"""A 2-rank fit whose all-to-alls need more shared memory than a 64 MiB ``/dev/shm`` holds.

``python _small_shm_fit.py <comm_transport> <out.pt>``: trains 3 steps (per rank: 8192 samples,
8 tables of dim 64 table-wise: 8 MiB chunks per destination, 4 slots deep) through Lightning's own
launcher, rank 0 saves the full state dict and prints how many chunks spilled out of shared memory.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    ParameterConstraints,
    ShardRecStrategy,
    SyntheticRecDataModule,
)

TABLES = [f"f{i}" for i in range(8)]


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(num_embeddings=500, embedding_dim=64, name=f"t_{f}", feature_names=[f]) for f in TABLES]
        )
        self.mlp = torch.nn.Linear(3 + 64 * len(TABLES), 1)

    def training_step(self, batch, i):
        x = torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)
        return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), batch.labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(transport: str, out: str) -> None:
    data = SyntheticRecDataModule(
        num_dense=3, tables=[{"name": f, "num_embeddings": 500} for f in TABLES], batch_size=8192, num_batches=6,
        pooling_factor=1.0, seed=3,
    )  # fmt: skip
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=["table_wise"]) for f in TABLES}
    strategy = ShardRecStrategy(comm_transport=transport, constraints=constraints, kernel="torch", pipeline=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Wide(), data)
    transport_ = next(iter(strategy.sharded.values())).env.transport
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(state, out)
        spilled = -1 if transport_ is None else transport_.spilled
        print(f"SHARDREC_SPILLED {spilled}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
