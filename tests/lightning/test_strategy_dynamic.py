"""A LightningModule with a dynamic table: Trainer(strategy="shardrec", devices=2) ends with the same
weights and id mappings as Trainer(devices=1) without the strategy, on the same global batches."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import external_launch, trainer

from lightning_shardrec import (
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    PoolingType,
    SyntheticRecDataModule,
)
from lightning_shardrec.modules import optimizer_reset_hook
from lightning_shardrec.testing import run_ranks

STEPS, BATCH = 5, 6  # BATCH per rank
TOL = {"rtol": 1e-5, "atol": 1e-6}
BUFFERS = ("slot_ids", "slot_step", "slot_count", "slot_gen")


class DynamicRec(L.LightningModule):
    """Raw ids of ``user`` (up to 400 distinct) into a dynamic table of 32 rows, beside a static ``item`` table."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t_user",
                    embedding_dim=8,
                    num_embeddings=32,
                    feature_names=["user"],
                    dynamic=DynamicConfig(num_buckets=4, ttl_steps=2),
                ),
                EmbeddingBagConfig(
                    name="t_item", embedding_dim=4, num_embeddings=30, feature_names=["item"], pooling=PoolingType.MEAN
                ),
            ]
        )
        self.mlp = torch.nn.Linear(3 + 12, 1)

    def training_step(self, batch, i):
        x = torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)
        return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), batch.labels)

    def configure_optimizers(self):
        opt = torch.optim.Adagrad(self.parameters(), lr=0.05)
        self.ebc.register_reset_hook(optimizer_reset_hook(opt))  # unsharded: new rows restart their state
        return opt


def data(batch_size: int) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=3,
        tables=[{"name": "user", "num_embeddings": 400}, {"name": "item", "num_embeddings": 30}],
        batch_size=batch_size,
        num_batches=STEPS,
        pooling_factor=3.0,
        seed=2,
    )


def fit_sharded(rank: int, world: int, pipeline: bool) -> tuple:
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    row_wise = {"t_user": ParameterConstraints(sharding_types=["row_wise"])}
    strategy = ShardRecStrategy(constraints=row_wise, pipeline=pipeline)
    model = DynamicRec()
    trainer(strategy=strategy, devices=world, max_steps=STEPS).fit(model, data(BATCH))
    kind = strategy.plan.get_plan_for_module("ebc")["t_user"].sharding_type.value
    mappers = {
        name: (m.row_offset, {k: v.clone() for k, v in m.state_dict().items()})
        for name, m in strategy.sharded["ebc"].dynamic_mappers().items()
    }
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}, mappers, kind


@pytest.mark.parametrize("pipeline", [False, True])
def test_shardrec_trains_a_dynamic_table_like_one_device(pipeline: bool) -> None:
    """Also with the pipelined input distribution (ids routed a batch ahead, mapped at their forward)."""
    results = run_ranks(fit_sharded, 2, pipeline)
    model = DynamicRec()
    trainer(devices=1, max_steps=STEPS).fit(model, data(2 * BATCH))
    want = model.state_dict()
    stats = model.ebc.dynamic_stats()["t_user"]
    assert stats["evictions"] > 0 and stats["expirations"] > 0
    for state, _, kind in results:
        assert kind == "row_wise"
        for k in ("ebc.embedding_bags.t_user.weight", "ebc.embedding_bags.t_item.weight", "mlp.weight", "mlp.bias"):
            torch.testing.assert_close(state[k], want[k], **TOL, msg=k)
    held = [m["t_user"] for _, m, _ in results]
    assert len(held) == 2  # 4 buckets: two on each rank
    for name in BUFFERS:
        got = torch.cat([b[name] for _, b in sorted(held, key=lambda h: h[0])])
        assert torch.equal(got, want[f"ebc.dynamic_tables.t_user.{name}"]), name
    assert all(int(b["step"]) == STEPS for _, b in held)
