"""``ShardRecStrategy(comm_transport=...)``: shared memory on one host, the process group otherwise, same weights."""

from __future__ import annotations

import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

STEPS = 4


def _fit(rank, world, transport):
    import lightning as L

    import lightning_shardrec  # noqa: F401
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    class DenseHook(L.Callback):
        hook = ""
        transports = ()

        def on_train_start(self, trainer, pl_module):
            self.hook = trainer.strategy.model.logger._get_ddp_logging_data().strs_map.get("comm_hook", "")
            pipeline = trainer.strategy.pipeline
            self.transports = (trainer.strategy._dense_transport, pipeline.env.transport if pipeline else None)

    external_launch(rank, world)
    constraints = {"t_big": ParameterConstraints(sharding_types=["row_wise"])}  # one reduce-scatter group too
    strategy = ShardRecStrategy(constraints=constraints, comm_transport=transport, pipeline=transport == "auto")
    seen = DenseHook()
    t = trainer(strategy=strategy, devices=world, max_steps=STEPS, callbacks=[seen])
    t.fit(Rec("adagrad"), data(6, STEPS))
    env = next(iter(strategy.sharded.values())).env
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    # teardown closed the dense all-reduce's and the pipeline's transports; the tables keep theirs
    closed = [t is None or t.closed for t in seen.transports] + [env.transport is None or not env.transport.closed]
    return env.transport is not None, seen.hook, state, all(closed)


def test_the_same_weights_through_shared_memory_and_the_process_group():
    shm = run_ranks(_fit, 2, "auto")  # with pipeline=True: the prefetch group gets its own transport
    pg = run_ranks(_fit, 2, "pg")
    for (on_shm, hook, state, closed), (on_pg, pg_hook, pg_state, _) in zip(shm, pg, strict=True):
        assert on_shm and not on_pg and closed
        assert hook == "_allreduce_hook" and pg_hook != "_allreduce_hook"
        assert state.keys() == pg_state.keys()
        for k in state:
            assert torch.equal(state[k], pg_state[k]), k  # 2 ranks: bit for bit
