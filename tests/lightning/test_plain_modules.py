"""An unchanged LightningModule built on plain nn.EmbeddingBag / nn.Embedding, under strategy="shardrec".

devices=2 and 3 end with the weights of devices=1 without the strategy (same global
batches), for each optimizer the tables can follow exactly; each rank holds its share of
a large table; checkpoints keep the module's own keys and load both ways.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import external_launch
from torch import nn

from lightning_shardrec import ParameterConstraints
from lightning_shardrec.testing import run_ranks

GLOBAL, STEPS, ROWS = 12, 4, 600


class TwoTower(L.LightningModule):  # what a user has today: plain torch embedding modules
    def __init__(self, optimizer: str = "adagrad", mode: str = "mean"):
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.EmbeddingBag(ROWS, 8, mode=mode)
        self.item = nn.Embedding(50, 8, padding_idx=0)
        self.top = nn.Linear(8, 1)
        self.optimizer = optimizer

    def forward(self, ids, offsets, items):
        return self.top(self.user(ids, offsets) * self.item(items).mean(1)).squeeze(1)

    def training_step(self, batch, i):
        ids, offsets, items, y = batch
        return F.binary_cross_entropy_with_logits(self(ids, offsets, items), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


def batches(lo: int, hi: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (GLOBAL,), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        items = torch.randint(0, 50, (GLOBAL, 3), generator=g)
        y = torch.rand(GLOBAL, generator=g).round()
        start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
        sub = lengths[lo:hi]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sub.cumsum(0)[:-1]])
        out.append((ids[start:end], offsets, items[lo:hi], y[lo:hi]))
    return out


def trainer(**kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def loader(lo: int, hi: int):
    return torch.utils.data.DataLoader(batches(lo, hi), batch_size=None)


def fit_sharded(rank, world, cases, ckpt_dir):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
    out = []
    for optimizer, mode in cases:
        strategy = ShardRecStrategy(constraints={"user": ParameterConstraints(sharding_types=["row_wise"])})
        model = TwoTower(optimizer, mode)
        t = trainer(strategy=strategy, devices=world, use_distributed_sampler=False, enable_checkpointing=False)
        t.fit(model, loader(lo, hi))
        held = sum(w.numel() for _, w in strategy.sharded["user"].local_shards()["user"])
        out.append(({k: v.clone() for k, v in strategy.full_state_dict().items()}, held))
    if ckpt_dir is not None:  # full format: one file under the plain model's keys
        strategy = ShardRecStrategy(checkpoint_format="full")
        t = trainer(strategy=strategy, devices=world, use_distributed_sampler=False, enable_checkpointing=False)
        t.fit(TwoTower(), loader(lo, hi))
        t.save_checkpoint(f"{ckpt_dir}/sharded_run.ckpt")
    return out


def reference(optimizer: str, mode: str) -> TwoTower:
    model = TwoTower(optimizer, mode)
    trainer(devices=1, enable_checkpointing=False).fit(model, loader(0, GLOBAL))
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_plain_modules_match_one_device(world, tmp_path):
    cases = [("adagrad", "mean"), ("sgd", "sum"), ("adagrad", "max")] if world == 2 else [("adagrad", "mean")]
    results = run_ranks(fit_sharded, world, cases, str(tmp_path) if world == 2 else None, timeout=600)
    for i, (optimizer, mode) in enumerate(cases):
        want = reference(optimizer, mode).state_dict()
        got, _ = results[0][i]
        assert set(got) == set(want), f"keys {sorted(got)} vs {sorted(want)}"
        for k, v in want.items():
            torch.testing.assert_close(
                got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, w=f"{optimizer}/{mode} {k}": f"{w}\n{m}"
            )
        held = [r[i][1] for r in results]
        assert sum(held) == ROWS * 8 and max(held) <= ROWS * 8 // world + 8, f"row-wise shares per rank: {held}"
    if world != 2:
        return
    # a checkpoint of the sharded run loads into the plain model, and a plain checkpoint resumes under shardrec
    saved = torch.load(tmp_path / "sharded_run.ckpt", weights_only=True)["state_dict"]
    plain = TwoTower()
    plain.load_state_dict(saved)
    torch.testing.assert_close(plain.user.weight, reference("adagrad", "mean").user.weight, rtol=1e-5, atol=1e-6)


def resume_from_plain(rank, world, ckpt):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
    strategy = ShardRecStrategy(checkpoint_format="full")
    t = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS + 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    t.fit(TwoTower(), torch.utils.data.DataLoader(batches(lo, hi) * 2, batch_size=None), ckpt_path=ckpt)
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


def test_plain_checkpoint_resumes_sharded(tmp_path):
    t = trainer(devices=1, enable_checkpointing=False)
    t.fit(TwoTower(), loader(0, GLOBAL))
    t.save_checkpoint(tmp_path / "plain.ckpt")
    got = run_ranks(resume_from_plain, 2, str(tmp_path / "plain.ckpt"), timeout=600)[0]
    want = TwoTower()
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS + 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(want, torch.utils.data.DataLoader(batches(0, GLOBAL) * 2, batch_size=None), ckpt_path=tmp_path / "plain.ckpt")
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}\n{m}")


def test_strategy_options_are_checked_by_name():
    from lightning_shardrec import ShardRecStrategy

    with pytest.raises(TypeError, match="ShardRecStrategy: embedding_modules must be True, False or a list of module"):
        ShardRecStrategy(embedding_modules="user_emb")
    with pytest.raises(ValueError, match="ShardRecStrategy: embedding_min_rows must be an int >= 0, got -5"):
        ShardRecStrategy(embedding_min_rows=-5)
