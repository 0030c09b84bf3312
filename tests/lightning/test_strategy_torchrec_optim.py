"""TorchRec's ways of choosing the tables' optimizer, under Trainer(strategy=ShardRecStrategy(...)).

``apply_optimizer_in_backward`` on the LightningModule's tables trains them as plain torch would
(devices=1, no strategy); a sharder's ``fused_params`` sets the fused rule; conflicts stop by name.
"""

from __future__ import annotations

import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec import FusedOptimConfig
from lightning_shardrec.testing import run_ranks

STEPS = 3


def _fit(rank, world, mode):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.distributed import EmbeddingBagCollectionSharder
    from lightning_shardrec.optim import apply_optimizer_in_backward

    model = Rec(optimizer="adagrad", lr=0.05)
    if mode in ("plain", "in_backward", "conflict"):
        apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.3})
    if mode == "plain":
        t = trainer(devices=1, max_steps=STEPS)
        t.fit(model, data(6, STEPS))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, None
    external_launch(rank, world)
    kwargs = {}
    if mode == "fused_params":
        kwargs["sharders"] = [EmbeddingBagCollectionSharder(fused_params={"optimizer": "sgd", "learning_rate": 0.3})]
    if mode == "conflict":
        kwargs["embedding_optimizer"] = "adagrad"
    try:
        t = trainer(strategy=ShardRecStrategy(**kwargs), devices=world, max_steps=STEPS)
        t.fit(model, data(6, STEPS))
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return {k: v.clone() for k, v in t.strategy.full_state_dict().items()}, t.strategy._config


def test_apply_optimizer_in_backward_trains_the_tables_as_plain_torch():
    want, _ = run_ranks(_fit, 1, "plain")[0]
    got, config = run_ranks(_fit, 1, "in_backward")[0]
    assert config == FusedOptimConfig(optimizer="sgd", lr=0.3)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_sharder_fused_params_and_conflicts_under_the_strategy():
    _, config = run_ranks(_fit, 1, "fused_params")[0]
    assert config == FusedOptimConfig(optimizer="sgd", lr=0.3)
    _, message = run_ranks(_fit, 1, "conflict")[0]
    assert message.startswith("UnsupportedFeatureError: ShardRecStrategy: embedding_optimizer=adagrad"), message
