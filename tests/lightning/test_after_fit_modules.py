"""After fit, ``model(batch)`` on rank 0 alone for every module kind the strategy shards (by default).

A model of an ``EmbeddingBagCollection`` with a dynamic table, an ``EmbeddingCollection`` and
plain ``nn.Embedding`` / ``nn.EmbeddingBag`` (sum and max) modules swapped by the strategy, fit
on 2 ranks (row-, table- and column-wise) with the default ``full_tables_after_fit`` (tables
far under 64 MiB): rank 0 alone runs the forward over the full tables it holds, equal to the
unsharded model loaded with the collective ``full_state_dict()``; its ``state_dict()`` equals
that too. Rank 1 alone is refused by name.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from _models import external_launch, trainer
from torch import nn

from lightning_shardrec import (
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from lightning_shardrec.testing import run_ranks

B, STEPS = 4, 3


class Mixed(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dyn = DynamicConfig(num_buckets=4, ttl_steps=2)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t_user", embedding_dim=4, num_embeddings=32, feature_names=["user"], dynamic=dyn
                ),
                EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=30, feature_names=["item"]),
            ]
        )
        self.ec = EmbeddingCollection(
            [EmbeddingConfig(name="t_seq", embedding_dim=4, num_embeddings=40, feature_names=["seq"])]
        )
        self.bag = nn.EmbeddingBag(50, 4, mode="sum")
        self.max_bag = nn.EmbeddingBag(20, 4, mode="max")
        self.emb = nn.Embedding(30, 4, padding_idx=0)
        self.top = nn.Linear(4, 1)

    def forward(self, batch):
        kjt, seq, ids, items = batch
        pooled = self.ebc(kjt).values().view(-1, 2, 4).sum(1)
        rows = self.ec(seq)["seq"]
        per_bag = torch.stack([r.sum(0) for r in rows.to_dense()])
        x = pooled + per_bag + self.bag(ids) + self.max_bag(ids % 20) + self.emb(items).sum(1)
        return self.top(x).squeeze(1)

    def training_step(self, batch, i):
        return F.binary_cross_entropy_with_logits(self(batch), torch.ones(B))

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3, (2 * B,), generator=g)
    users = torch.randint(0, 10**6, (int(lengths[:B].sum()),), generator=g)  # raw ids: the dynamic table maps them
    items = torch.randint(0, 30, (int(lengths[B:].sum()),), generator=g)
    kjt = KeyedJaggedTensor(["user", "item"], torch.cat([users, items]), lengths=lengths)
    seq_lengths = torch.randint(1, 4, (B,), generator=g)
    seq = KeyedJaggedTensor(["seq"], torch.randint(0, 40, (int(seq_lengths.sum()),), generator=g), lengths=seq_lengths)
    return kjt, seq, torch.randint(0, 50, (B, 3), generator=g), torch.randint(0, 30, (B, 2), generator=g)


def fit_then_alone(rank, world):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.errors import CollectiveCallError

    external_launch(rank, world)
    model = Mixed()
    kinds = {"t_user": "row_wise", "t_item": "table_wise", "t_seq": "row_wise", "bag": "column_wise"}
    kinds.update(max_bag="row_wise", emb="table_wise")
    constraints = {name: ParameterConstraints(sharding_types=[kind]) for name, kind in kinds.items()}
    t = trainer(strategy=ShardRecStrategy(constraints=constraints), devices=world, max_steps=STEPS)
    t.fit(model, torch.utils.data.DataLoader([batch(10 * s + rank) for s in range(STEPS)], batch_size=None))
    kinds = sorted(type(m).__name__ for m in t.strategy.sharded.values())
    full = {k: v.clone() for k, v in t.strategy.full_state_dict().items()}  # collective: every rank
    probe = batch(99)
    out = {"kinds": kinds, "full": full}
    try:
        with torch.no_grad():
            out["alone"] = model(probe).clone()  # this rank alone
        out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    except CollectiveCallError as e:
        out["forward"] = str(e)
    return out


def test_rank_zero_runs_every_sharded_module_kind_alone_after_fit():
    first, second = run_ranks(fit_then_alone, 2)
    assert first["kinds"] == [
        "ShardedEmbeddingBagCollection",
        "ShardedEmbeddingCollection",
        "ShardedPlainEmbedding",
        "ShardedPlainEmbeddingBag",
        "ShardedPlainMaxEmbeddingBag",
    ]
    plain = Mixed()
    plain.load_state_dict(first["full"])
    with torch.no_grad():
        torch.testing.assert_close(first["alone"], plain(batch(99)), rtol=1e-5, atol=1e-6)
    assert set(first["state"]) == set(first["full"])
    for k, v in first["full"].items():
        torch.testing.assert_close(first["state"][k], v, rtol=0, atol=0, msg=k)
    assert second["forward"].startswith("ShardedEmbeddingBagCollection 'ebc' was called outside trainer.fit")
    assert second["forward"].endswith("(the full tables are held only on rank 0 after a fit)")
