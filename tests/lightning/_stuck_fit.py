"""A 2-rank fit that gets stuck in a collective: ``python _stuck_fit.py <comm_transport> <pipeline>``.

At step 2 rank 1 enters a barrier that rank 0 never joins (rank 0 goes on to the next step's
all-to-alls and waits there for rank 1): both ranks block in collectives, with the heartbeat
watchdog off. Rank 1 prints ``SHARDREC_STUCK`` first; the test then sends SIGTERM.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import TABLES, data

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, ParameterConstraints, ShardRecStrategy


class Stuck(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t_{f}", feature_names=[f])
                for f, n, d, _ in TABLES
            ]
        )
        self.mlp = torch.nn.Linear(3 + sum(d for _, _, d, _ in TABLES), 1)

    def training_step(self, batch, i):
        if i == 2 and self.global_rank == 1:
            print("SHARDREC_STUCK", flush=True)
            dist.barrier()  # rank 0 never comes
        x = torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)
        return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), batch.labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=["row_wise"]) for f, *_ in TABLES}  # all-to-alls
    strategy = ShardRecStrategy(
        comm_transport=sys.argv[1], pipeline=sys.argv[2] == "1", heartbeat_timeout=None, constraints=constraints
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=50, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Stuck(), data(4, 50))
