"""An existing recommender on plain ``nn.Embedding`` / ``nn.EmbeddingBag``, sharded without a code change.

``Retrieval`` is written as people write it today: a user tower (an ``nn.Embedding`` of
user ids plus an ``nn.EmbeddingBag`` mean of the user's recent items) and an item tower
(an ``nn.Embedding`` of item ids), scored by a dot product, trained with ``Adagrad``.
Nothing in it knows about this library. Run it with DDP, then with shardrec:

    python examples/existing_model/train.py --strategy ddp       # every rank holds every table
    python examples/existing_model/train.py --strategy shardrec  # each rank holds its share

With ``shardrec`` the strategy swaps each embedding module for a sharded one with the same
call and results, plans the tables, trains them with the fused Adagrad derived from the
optimizer, and saves them under the modules' own keys (``user_emb.weight``). Each rank prints
the embedding bytes it holds, its peak memory, and the training speed.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_shardrec  # noqa: F401  (registers strategy="shardrec")

USERS, ITEMS, DIM, HISTORY = 200_000, 100_000, 32, 8


class Retrieval(L.LightningModule):
    """``score = <user_tower(user, history), item_tower(item)>``; BCE on clicks."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.user_emb = nn.Embedding(USERS, DIM)
        self.history = nn.EmbeddingBag(ITEMS, DIM, mode="mean")
        self.item_emb = nn.Embedding(ITEMS, DIM)
        self.user_mlp = nn.Sequential(nn.Linear(2 * DIM, 64), nn.ReLU(), nn.Linear(64, DIM))
        self.item_mlp = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, DIM))

    def forward(self, user: torch.Tensor, history: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        u = self.user_mlp(torch.cat([self.user_emb(user), self.history(history)], dim=1))
        return (u * self.item_mlp(self.item_emb(item))).sum(1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:  # noqa: ANN001
        user, history, item, label = batch
        loss = F.binary_cross_entropy_with_logits(self(user, history, item), label)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.lr)


def dataset(rows: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Synthetic clicks: users, their last ``HISTORY`` items ([rows, HISTORY], one bag each), items, labels."""
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, USERS, (rows,), generator=g)
    history = torch.randint(0, ITEMS, (rows, HISTORY), generator=g)
    item = torch.randint(0, ITEMS, (rows,), generator=g)
    label = ((user + item) % 3 == 0).float()
    return torch.utils.data.TensorDataset(user, history, item, label)


class Speed(L.Callback):
    """Steps per second after ``warmup`` steps (rank 0)."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup, self.start, self.steps = warmup, 0.0, 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.steps += 1
        if self.steps == self.warmup:
            self.start = time.perf_counter()

    def steps_per_second(self) -> float:
        return (self.steps - self.warmup) / max(time.perf_counter() - self.start, 1e-9)


def embedding_bytes(trainer: L.Trainer) -> int:
    """Bytes of embedding weights this rank holds: its shards under shardrec, the whole tables otherwise."""
    sharded = getattr(trainer.strategy, "sharded", {})
    if sharded:
        return sum(
            w.numel() * w.element_size() for s in sharded.values() for v in s.local_shards().values() for _, w in v
        )
    model = trainer.lightning_module
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    )


def main(argv: Sequence[str] | None = None, **trainer_kwargs: object) -> dict[str, float]:
    """Train; returns this rank's figures (embedding MiB, peak RSS MiB, steps/s, final loss)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="shardrec", help="ddp or shardrec (or auto: 1 process)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    speed = Speed(warmup=min(5, args.steps - 1))
    trainer = L.Trainer(
        **{
            "strategy": args.strategy,  # the only line that changes
            "accelerator": "cpu",
            "devices": args.devices,
            "max_steps": args.steps,
            "logger": False,
            "enable_checkpointing": False,
            "callbacks": [speed],
            **trainer_kwargs,
        }
    )
    loader = torch.utils.data.DataLoader(
        dataset(args.steps * args.global_batch), batch_size=args.global_batch // args.devices, shuffle=True
    )
    trainer.fit(Retrieval(), loader)
    figures = {
        "embedding_mib": embedding_bytes(trainer) / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps_per_s": speed.steps_per_second(),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
    }
    print(f"rank {trainer.global_rank}: " + ", ".join(f"{k}={v:.3f}" for k, v in figures.items()), flush=True)
    return figures


if __name__ == "__main__":
    main()
