"""A finished run leaves nothing behind: the process groups the strategy made are destroyed and
its threads joined in teardown (a gloo group left to interpreter exit can abort the process),
while the default group still serves ``trainer.save_checkpoint`` after ``fit``."""

from __future__ import annotations

import threading

from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks


def fit_then_save(rank, world, root, pipeline):
    from torch.distributed.distributed_c10d import _world

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    before = set(_world.pg_map)
    strategy = ShardRecStrategy(pipeline=pipeline)
    t = trainer(strategy=strategy, devices=world, max_steps=3)
    t.fit(Rec(), data(4, 3))
    left = len(set(_world.pg_map) - before)
    t.save_checkpoint(f"{root}/pipeline_{pipeline}.ckpt")  # collective on the default group: still there
    prefetching = [p for p, c in strategy.sharded.items() if c._prefetch_env is not None]
    threads = [th.name for th in threading.enumerate() if th.name.startswith("shardrec-")]
    return left, prefetching, threads, strategy.pipeline is not None


def test_fit_destroys_its_groups_and_joins_its_threads(tmp_path):
    for pipeline in (False, True):
        for left, prefetching, threads, piped in run_ranks(fit_then_save, 2, str(tmp_path), pipeline):
            assert piped == pipeline
            assert (left, prefetching, threads) == (0, [], [])
        assert (tmp_path / f"pipeline_{pipeline}.ckpt").is_dir()
