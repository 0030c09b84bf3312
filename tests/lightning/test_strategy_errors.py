"""ShardRecStrategy: registration, bad settings and models without tables."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from _models import Rec, data, external_launch, trainer

import lightning_shardrec  # noqa: F401
from lightning_shardrec import FusedOptimConfig, ShardRecStrategy
from lightning_shardrec.errors import PlannerError
from lightning_shardrec.lightning.parameters.optimizers import derive_fused_config, find_group, remove_params
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
    if what == "momentum":
        t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2)
        model = Rec("sgd")
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif what == "reserve":  # the CPU ranks' memory just above what the tables need: refused by the reserve
        from lightning_shardrec.planner import EmbeddingShardingPlanner, Topology
        from lightning_shardrec.planner.machine import topology

        need = EmbeddingShardingPlanner(Topology(world, compute_device="cpu"), reserve=0.0).plan(Rec()).stats
        topology.host_memory = lambda: world * int(need.max_storage / 0.95)  # the host's, shared by its ranks
        t = trainer(strategy=ShardRecStrategy(planner_reserve=0.1), devices=world, max_steps=2)
        model = Rec()
    else:  # no embedding collection: plain DDP
        t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2)
        model = Rec()
        model.ebc = torch.nn.Identity()
        model.training_step = lambda batch, batch_idx: model.mlp(torch.nn.functional.pad(batch.dense, (0, 24))).mean()
    from lightning_shardrec.planner.machine import memory, topology

    try:
        t.fit(model, data(4, 2))
    except (ValueError, PlannerError) as e:
        return str(e)
    finally:
        topology.host_memory = memory.host_memory  # the pooled rank process goes on to other tests
    return "ok"


def test_strategy_planner_keeps_the_reserve():
    msg = run_ranks(fit_with, 1, "reserve")[0]
    assert "no sharding plan fits in memory" in msg
    assert re.search(r"per rank: [\d.]+ MiB capacity - 10% reserve \([\d.]+ MiB\) = [\d.]+ MiB for tables", msg)


def test_underivable_optimizer_is_refused_at_setup():
    assert "SGD with momentum=0.9 has no fused row-sparse form" in run_ranks(fit_with, 2, "momentum")[0]


def test_model_without_tables_trains_as_ddp():
    assert run_ranks(fit_with, 2, "plain") == ["ok", "ok"]


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward hands the tables a NaN gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Poisoned(Rec):
    """From step 2 on, a NaN loss (``where="loss"``) or a NaN gradient into the tables (``"grad"``)."""

    def __init__(self, where):
        super().__init__("sgd")
        self.where = where

    def training_step(self, batch, i):
        if i < 2:
            return super().training_step(batch, i)
        if self.where == "loss":
            return super().training_step(batch, i) * float("nan")
        pooled = _PoisonGrad.apply(self.ebc(batch.sparse).values())
        out = self.mlp(torch.cat([batch.dense, pooled], 1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(out, batch.labels)


def fit_poisoned(rank, world, where):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.errors import NonFiniteError

    external_launch(rank, world)
    kinds = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "table_wise"}
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
    strategy = ShardRecStrategy(check_finite=True, constraints=constraints)
    t = trainer(strategy=strategy, devices=world, max_steps=4)
    try:
        t.fit(Poisoned(where), data(4, 4))
    except NonFiniteError as e:
        tables = {k: v for k, v in strategy.full_state_dict().items() if k.startswith("ebc.")}
        return str(e), t.global_step, all(bool(torch.isfinite(v).all()) for v in tables.values())
    return "no error", t.global_step, None


def test_check_finite_stops_before_a_table_is_poisoned():
    for rank, (msg, step, clean) in enumerate(run_ranks(fit_poisoned, 2, "loss")):
        assert msg == "the loss is nan at step 2; stopped before backward, so no embedding table was updated with it"
        assert (step, clean) == (2, True), rank
    for msg, step, clean in run_ranks(fit_poisoned, 2, "grad"):
        assert "the gradient reaching its fused update holds nan; the table was not updated" in msg
        assert msg.startswith("table 't_")
        assert (step, clean) == (2, True)
