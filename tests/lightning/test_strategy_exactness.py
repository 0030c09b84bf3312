"""The acceptance test users care about most: Trainer(strategy="shardrec", devices=W) ends with
the same weights as Trainer(devices=1) without the strategy on the same global batches,
for every sharding type the planner can choose (forced through constraints)."""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

STEPS = 4
BATCH = 6  # per rank
TOL = {"rtol": 1e-5, "atol": 1e-6}


def fit_sharded(rank, world, sharding_type, optimizer, options=None):
    import lightning_shardrec  # noqa: F401
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[sharding_type]) for f in ("big", "mid", "tiny")}
    strategy = ShardRecStrategy(constraints=constraints)
    t = trainer(strategy=strategy, devices=world, max_steps=STEPS)
    model = Rec(optimizer, **(options or {}))
    t.fit(model, data(BATCH, STEPS))
    types = {name: p.sharding_type.value for name, p in strategy.plan.get_plan_for_module("ebc").items()}
    state = strategy.full_state_dict()
    return {k: v.clone() for k, v in state.items()}, types


def fit_reference(world, optimizer, options=None):
    model = Rec(optimizer, **(options or {}))
    trainer(devices=1, max_steps=STEPS).fit(model, data(BATCH * world, STEPS))
    return model.state_dict()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_shardrec_matches_single_device(world, sharding_type):
    optimizer = "adagrad" if world == 2 else "sgd"
    results = run_ranks(fit_sharded, world, sharding_type, optimizer)
    want = fit_reference(world, optimizer)
    for state, types in results:
        assert set(types.values()) == {sharding_type}
        assert set(state) == set(want)
        for k in want:
            torch.testing.assert_close(state[k], want[k], **TOL, msg=f"{sharding_type}: {k}")


@pytest.mark.parametrize("options", [{"scheduler": True}, {"manual": True}, {"manual": True, "scheduler": True}])
def test_lr_scheduler_and_manual_optimization(options):
    """A StepLR halving the lr every step moves the fused tables' lr too; manual optimization works."""
    results = run_ranks(fit_sharded, 2, "row_wise", "adagrad", options)
    want = fit_reference(2, "adagrad", options)
    for state, _ in results:
        for k in want:
            torch.testing.assert_close(state[k], want[k], **TOL, msg=f"{options}: {k}")
