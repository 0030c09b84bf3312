"""A second ``fit()`` with the same strategy reuses its process groups instead of creating more."""

from __future__ import annotations

from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks


def fit_twice(rank, world):
    import torch.distributed as dist

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    model = Rec()
    t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2)
    t.fit(model, data(4, 4))
    groups = len(dist.distributed_c10d._world.pg_map)
    t.fit_loop.epoch_loop.max_steps = 4
    t.fit(model, data(4, 4))
    return groups, len(dist.distributed_c10d._world.pg_map), t.global_step


def test_second_fit_creates_no_process_group():
    for first, second, steps in run_ranks(fit_twice, 2):
        assert steps == 4
        assert second == first
