"""ShardRecStrategy: registration, bad settings and models without tables."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from _models import Rec, data, external_launch, trainer

import lightning_shardrec  # noqa: F401
from lightning_shardrec import FusedOptimConfig, ShardRecStrategy
from lightning_shardrec.lightning.optimizers import derive_fused_config, find_group, remove_params
from lightning_shardrec.testing import run_ranks


def test_alias_is_registered_on_import():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "shardrec" in StrategyRegistry
    assert isinstance(
        L.Trainer(strategy="shardrec", accelerator="cpu", devices=1, logger=False).strategy, ShardRecStrategy
    )


def test_bad_settings_fail_with_choices():
    with pytest.raises(
        ValueError, match="unknown embedding optimizer 'lamb'; available: sgd, adagrad, rowwise_adagrad, adam, adamw"
    ):
        ShardRecStrategy(embedding_optimizer="lamb")
    with pytest.raises(ValueError, match="unknown kernel 'cuda'; available: auto, fbgemm, torch"):
        ShardRecStrategy(kernel="cuda")


def test_derived_optimizers():
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    cfg = derive_fused_config(adam, adam.param_groups[0])
    assert cfg == FusedOptimConfig(optimizer="adamw", lr=0.01, eps=1e-8, beta1=0.8, beta2=0.9, weight_decay=0.1)
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="SGD with momentum=0.9 has no fused row-sparse form"):
        derive_fused_config(sgd, sgd.param_groups[0])
    rms = torch.optim.RMSprop(p)
    with pytest.raises(ValueError, match="cannot derive a fused embedding optimizer from RMSprop"):
        derive_fused_config(rms, rms.param_groups[0])


def test_tables_leave_the_dense_optimizer():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adagrad([a, b])  # Adagrad allocates state eagerly
    assert find_group([opt], [b])[1] is opt.param_groups[0]
    remove_params([opt], [b])
    assert opt.param_groups[0]["params"] == [a] and b not in opt.state


def fit_with(rank, world, what):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    if what == "accumulate":
        t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2, accumulate_grad_batches=2)
        model = Rec()
    elif what == "momentum":
        t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2)
        model = Rec("sgd")
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:  # no embedding collection: plain DDP
        t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2)
        model = Rec()
        model.ebc = torch.nn.Identity()
        model.training_step = lambda batch, batch_idx: model.mlp(torch.nn.functional.pad(batch.dense, (0, 24))).mean()
    try:
        t.fit(model, data(4, 2))
    except ValueError as e:
        return str(e)
    return "ok"


def test_accumulation_and_underivable_optimizer_are_refused_at_setup():
    assert "accumulate_grad_batches=2 is not supported" in run_ranks(fit_with, 2, "accumulate")[0]
    assert "SGD with momentum=0.9 has no fused row-sparse form" in run_ranks(fit_with, 2, "momentum")[0]


def test_model_without_tables_trains_as_ddp():
    assert run_ranks(fit_with, 2, "plain") == ["ok", "ok"]
