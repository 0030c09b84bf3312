"""Accumulation and global-norm clipping with fused tables (issue 31): the table updates wait for the
optimizer step, and ``Trainer(strategy="shardrec", devices=W)`` ends with the weights of
``Trainer(devices=1)`` on the same global batches with the same ``accumulate_grad_batches`` /
``gradient_clip_val``."""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

BATCH = 6  # per rank
BATCHES = 6  # one epoch: k=2 -> 3 steps, k=4 -> 2 steps (the last window is 2 batches)
TOL = {"rtol": 1e-5, "atol": 1e-6}
TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def fit_sharded(rank, world, sharding, optimizer, options):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    options = dict(options)
    kinds = {"t_big": sharding, "t_mid": sharding, "t_tiny": "data_parallel" if sharding == "mixed" else sharding}
    if sharding == "mixed":
        kinds.update(t_big="row_wise", t_mid="column_wise")
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
    strategy = ShardRecStrategy(constraints=constraints, pipeline=options.pop("pipeline", False))
    t = trainer(strategy=strategy, devices=world, max_epochs=1, **options)
    t.fit(Rec(optimizer, lr=0.1), data(BATCH, BATCHES))
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


def fit_reference(world, optimizer, options):
    options = {k: v for k, v in options.items() if k != "pipeline"}
    model = Rec(optimizer, lr=0.1)
    trainer(devices=1, max_epochs=1, **options).fit(model, data(BATCH * world, BATCHES))
    return model.state_dict()


def assert_same(got, want, what):
    assert set(got) == set(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=f"{what}: {k}")


@pytest.mark.parametrize(
    ("world", "sharding", "optimizer", "options"),
    [
        (2, "row_wise", "adagrad", {"accumulate_grad_batches": 2}),
    ],
)
def test_matches_one_process(world, sharding, optimizer, options):
    want = fit_reference(world, optimizer, options)
    for rank, got in enumerate(run_ranks(fit_sharded, world, sharding, optimizer, options)):
        assert_same(got, want, f"{sharding} {optimizer} {options} W={world} rank {rank}")
