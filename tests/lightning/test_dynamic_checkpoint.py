"""Dynamic tables through the Lightning strategy: save in ``fit``, resume with ``ckpt_path=`` on
other devices, and read the checkpoint into the plain model (``lightning_shardrec.lightning.load_from_checkpoint``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import external_launch, trainer

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, SyntheticRecDataModule
from lightning_shardrec.lightning import load_from_checkpoint
from lightning_shardrec.testing import run_ranks

GLOBAL_BATCH, STEPS, ROWS, RAW_IDS = 12, 8, 16, 60  # raw ids in [0, 60) for a 16-row table: it evicts
TOL = {"rtol": 1e-4, "atol": 1e-5}


class DynRec(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dyn = DynamicConfig(num_buckets=8, eviction="lru", min_count=2, ttl_steps=4)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=ROWS, feature_names=["u"], dynamic=dyn),
                EmbeddingBagConfig(name="item", embedding_dim=4, num_embeddings=20, feature_names=["i"]),
            ]
        )
        self.mlp = torch.nn.Linear(3 + 8, 1)

    def forward(self, batch):
        return self.mlp(torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)).squeeze(1)

    def training_step(self, batch, i):
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)


def _data(world: int) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=3,
        tables=[{"name": "u", "num_embeddings": RAW_IDS}, {"name": "i", "num_embeddings": 20}],
        batch_size=GLOBAL_BATCH // world,
        num_batches=STEPS,
        pooling_factor=3.0,
        seed=3,
    )


def _plan(world: int) -> dict:
    """The dynamic table row-wise by bucket ranges (8 buckets over ``world`` ranks)."""
    from lightning_shardrec.planner import ParameterSharding, ShardMetadata

    cuts = [ROWS // 8 * (8 * r // world) for r in range(world + 1)]
    shards = [ShardMetadata((a, 0), (b - a, 4), r) for r, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))]
    return {"user": ParameterSharding("row_wise", "fused", [s.rank for s in shards], shards)}


def fit(rank: int, world: int, steps: int, ckpt_in: str | None, ckpt_out: str | None, fmt: str = "sharded"):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(plan=_plan(world), checkpoint_format=fmt)
    t = trainer(strategy=strategy, devices=world, max_steps=steps)
    t.fit(DynRec(), _data(world), ckpt_path=ckpt_in)
    if ckpt_out:
        t.save_checkpoint(ckpt_out)
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


def _resume(tmp_path: Path, fmt: str, world: int) -> None:
    straight = run_ranks(fit, 2, STEPS, None, None)[0]
    stats = straight["ebc.dynamic_tables.user.counters"].sum(0).tolist()
    assert stats[0] > ROWS and stats[1] > 0 and stats[4] > 0  # admissions beyond capacity: evictions; drops
    half = str(tmp_path / f"half-{fmt}.ckpt")
    saved = run_ranks(fit, 2, STEPS // 2, None, half, fmt)[0]
    assert Path(half).is_dir() == (fmt == "sharded")
    resumed = run_ranks(fit, world, STEPS, half, None)[0]
    assert sorted(resumed) == sorted(straight)
    for k, v in straight.items():
        if "dynamic_tables" in k:  # ids, slots, eviction metadata, counters: exact
            assert torch.equal(resumed[k], v), (fmt, k)
        else:
            torch.testing.assert_close(resumed[k], v, **TOL, msg=f"{fmt}: {k}")
    plain = load_from_checkpoint(DynRec, half)  # the unsharded model, strict keys
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), (fmt, k)


def test_sharded_checkpoint_resumes_on_3_devices_and_loads_into_the_plain_model(tmp_path: Path) -> None:
    _resume(tmp_path, "sharded", 3)


@pytest.mark.slow
def test_full_checkpoint_resumes_on_1_device_and_loads_into_the_plain_model(tmp_path: Path) -> None:
    _resume(tmp_path, "full", 1)
