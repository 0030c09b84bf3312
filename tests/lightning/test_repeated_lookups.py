"""A table looked up several times in one step is exact (issue 44, item 2).

A two-tower model looks its item table up twice per step (positives, then negatives) and trains
with Adagrad. Under ``strategy="shardrec"`` the rows of that table move once per step with the
summed gradient of both lookups, so ``devices=1`` and ``devices=2`` end with the weights of the
plain one-process run (no strategy) on the same global batches: plain ``nn.Embedding`` /
``nn.EmbeddingBag`` modules and the library's collections, every fused sharding type forced on the
item table, with and without ``pipeline=True``. Where the step cannot be summed (fbgemm's kernel
updates inside each lookup's backward) a ``RepeatedLookupError`` stops the fit at the second call.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import external_launch
from torch import nn

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, ParameterConstraints, PoolingType
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.testing import run_ranks

GLOBAL, STEPS, USERS, ITEMS, NEG = 12, 4, 300, 40, 3
TOL = {"rtol": 1e-5, "atol": 1e-6}


class PlainTwoTower(L.LightningModule):
    """Plain torch modules: the item ``nn.Embedding`` is called for positives and again for negatives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.EmbeddingBag(USERS, 8, mode="mean")
        self.item = nn.Embedding(ITEMS, 8)
        self.top = nn.Linear(1, 1, bias=False)  # a bias would get a zero gradient (softmax over 2)

    def towers(self, batch):
        ids, offsets, pos, neg = batch[:4]
        u = self.user(ids, offsets)
        return u, self.item(pos), self.item(neg).sum(1)  # two lookups of one table

    def training_step(self, batch, i):
        u, p, n = self.towers(batch)
        score = self.top(torch.stack([(u * p).sum(1), (u * n).sum(1)], 1).unsqueeze(2)).squeeze(2)
        return F.cross_entropy(score, torch.zeros(score.shape[0], dtype=torch.long))

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


class CollectionTwoTower(PlainTwoTower):
    """The library's ``EmbeddingBagCollection``: the item collection called with two KJTs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        del self.user, self.item
        self.users = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="user", num_embeddings=USERS, embedding_dim=8, feature_names=["u"])]
        )
        self.items = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="item", num_embeddings=ITEMS, embedding_dim=8, feature_names=["i"], pooling=PoolingType.SUM
                )
            ]
        )

    def towers(self, batch):
        ids, offsets, pos, neg = batch[:4]
        b = pos.shape[0]
        lengths = torch.diff(torch.cat([offsets, torch.tensor([ids.numel()])]))
        u = self.users(KeyedJaggedTensor(keys=["u"], values=ids, lengths=lengths))["u"]
        p = self.items(KeyedJaggedTensor(keys=["i"], values=pos, lengths=torch.ones(b, dtype=torch.long)))["i"]
        n = self.items(KeyedJaggedTensor(keys=["i"], values=neg.flatten(), lengths=torch.full((b,), NEG)))["i"]
        return u, p, n


MODELS = {"plain": PlainTwoTower, "collection": CollectionTwoTower}
ITEM_TABLE = {"plain": "item", "collection": "item"}


def batches(lo: int, hi: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(1, 4, (GLOBAL,), generator=g)
        ids = torch.randint(0, USERS, (int(lengths.sum()),), generator=g)
        pos = torch.randint(0, ITEMS, (GLOBAL,), generator=g)
        neg = torch.randint(0, ITEMS, (GLOBAL, NEG), generator=g)
        start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[lo:hi].cumsum(0)[:-1]])
        out.append((ids[start:end], offsets, pos[lo:hi], neg[lo:hi]))
    return out


def trainer(**kw) -> L.Trainer:
    base = dict(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    return L.Trainer(**{**base, **kw})


def loader(rank: int, world: int):
    lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
    return torch.utils.data.DataLoader(batches(lo, hi), batch_size=None)


def fit_sharded(rank, world, cases):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.optim import RepeatedLookups

    external_launch(rank, world)
    out = []
    counting = RepeatedLookups.seen
    for model_name, sharding, options in cases:
        options = dict(options)
        extra = fit_options(options.pop("fp16", False))
        if options.pop("no_sum", False):  # no counting: each lookup updates in its own backward
            RepeatedLookups.seen = lambda self, kernel: None
        constraints = {ITEM_TABLE[model_name]: ParameterConstraints(sharding_types=[sharding])}
        strategy = ShardRecStrategy(constraints=constraints, **{"kernel": "torch", **options})
        model = MODELS[model_name]()
        try:
            trainer(strategy=strategy, devices=world, **extra).fit(model, loader(rank, world))
        finally:
            RepeatedLookups.seen = counting
        plan = {n: p.sharding_type.value for m in strategy.plan.plan.values() for n, p in m.items()}
        out.append(({k: v.clone() for k, v in strategy.full_state_dict().items()}, plan))
    return out


def fit_options(fp16: bool) -> dict:
    """``precision="16-mixed"`` on CPU (Lightning's CPU GradScaler, as test_strategy_precision)."""
    if not fp16:
        return {}
    from lightning.pytorch.plugins.precision import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu")]}


def reference(model_name: str, fp16: bool = False) -> dict:
    model = MODELS[model_name]()
    trainer(devices=1, **fit_options(fp16)).fit(model, loader(0, 1))
    return model.state_dict()


def check(world, cases):
    results = run_ranks(fit_sharded, world, cases, timeout=600)
    for i, (model_name, sharding, options) in enumerate(cases):
        want = reference(model_name, options.get("fp16", False))
        for rank, result in enumerate(results):
            got, plan = result[i]
            assert plan[ITEM_TABLE[model_name]] == sharding
            assert set(got) == set(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], **TOL, msg=f"{model_name}/{sharding}/{options} r{rank} {k}")


def test_looked_up_twice_on_one_device_equals_one_process():
    check(
        1,
        [
            ("plain", "table_wise", {}),
            ("collection", "table_wise", {}),
            ("plain", "row_wise", {"fp16": True}),  # the loss scaler's replays summed (ScaledTableUpdates)
        ],
    )


def test_looked_up_twice_on_two_devices_equals_one_process():
    check(
        2,
        [
            ("plain", "row_wise", {}),
            ("plain", "table_wise", {"pipeline": True}),
            ("collection", "column_wise", {}),
            ("collection", "row_wise", {"pipeline": True}),
        ],
    )


@pytest.mark.slow
def test_every_fused_sharding_type_equals_one_process():
    types = ("table_wise", "row_wise", "column_wise", "table_row_wise")
    check(2, [(m, s, {"pipeline": p}) for m in MODELS for s in types for p in (False, True)])


def test_a_second_lookup_without_the_sum_moves_the_rows_twice():
    """What the tests above catch: two in-backward updates differ from the one-process run."""
    want = reference("plain")
    ((got, _),) = run_ranks(fit_sharded, 1, [("plain", "table_wise", {"no_sum": True})])[0]
    assert (got["item.weight"] - want["item.weight"]).abs().max() > 1e-3


def fit_fbgemm(rank, world):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    item = {"item": ParameterConstraints(sharding_types=["table_wise"])}
    trainer(strategy=ShardRecStrategy(constraints=item, kernel="fbgemm"), devices=world).fit(
        PlainTwoTower(), loader(rank, world)
    )


def test_a_kernel_that_cannot_sum_stops_at_the_second_call():
    pytest.importorskip("fbgemm_gpu")
    with pytest.raises(RuntimeError) as info:
        run_ranks(fit_fbgemm, 1, timeout=600)
    text = str(info.value)
    assert "RepeatedLookupError: tables ['item'] were looked up a second time in one training step" in text.replace(
        "lightning_shardrec.errors.", ""
    )
    assert "the fbgemm kernel updates inside each backward" in text
    assert "Pass ShardRecStrategy(kernel='torch') (the step's lookups are then summed before one update)" in text
    assert "in towers" in text  # raised in forward, at the second call
