"""The strategies' plain objects, used without a Trainer or Fabric (issue 45, item 4).

``ShardedTables`` (planner step, sharding, fused optimizer), ``DenseReplicas`` (DDP on its own group),
``ShardedCheckpoints``, ``StepUpdates`` and ``FailureHandling`` are what both strategies hold; here a
plain PyTorch loop on 2 ranks drives them and ends with the weights of one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _models import TABLES
from test_fabric import BATCH, TOL, Net, batches, loss_of, reference

from lightning_shardrec.testing import run_ranks


class Ranks:
    """What ShardedCheckpoints needs of a strategy, on the default process group."""

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    def broadcast(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self, name=None) -> None:
        dist.barrier()


def plain_loop(rank, world, path):
    from lightning.pytorch.plugins.precision import Precision

    from lightning_shardrec import ParameterConstraints
    from lightning_shardrec.errors import NonFiniteError
    from lightning_shardrec.lightning.checkpoints.checkpointing import ShardedCheckpoints
    from lightning_shardrec.lightning.parameters.dense import DenseReplicas
    from lightning_shardrec.lightning.parameters.tables import ShardedTables
    from lightning_shardrec.lightning.parameters.updates import StepUpdates
    from lightning_shardrec.lightning.strategies.options import ShardRecOptions

    row_wise = {f"t_{f}": ParameterConstraints(sharding_types=["row_wise"]) for f, *_ in TABLES}
    tables = ShardedTables(ShardRecOptions(constraints=row_wise))
    model = Net()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    collections = tables.find(model)
    table_params = [p for c in collections.values() for p in c.parameters()]
    holder = tables.pick_holder([opt], table_params)
    tables.shard(model, tables.options.fused_config(holder, None), torch.device("cpu"), local_world_size=world)
    tables.hand_over([opt], collections, table_params, holder)
    kernels = tables.link(holder)
    dense = DenseReplicas(lambda: dist.new_group(backend="gloo"))
    ddp = dense.wrap(tables, model, None)
    updates = StepUpdates(lambda: torch.device("cpu"), Precision)
    updates.attach(kernels, holder, next(iter(tables.sharded.values())).env.pg, False, check_finite=True)
    try:
        updates.check_loss(torch.tensor(float("nan")), 0)
        refused = None
    except NonFiniteError as e:
        refused = str(e)
    for batch in batches(rank, world, BATCH)[:2]:
        opt.zero_grad()
        updates.new_step()
        loss_of(ddp, batch).backward()
        opt.step()
    updates.detach()
    trained = {k: v.clone() for k, v in tables.full_state(tables.dense_state(model.state_dict()), rank).items()}

    checkpoints = ShardedCheckpoints(tables, Ranks())
    meta = {"step": 2}
    checkpoints.add_meta(meta)
    checkpoints.save_sharded(path, tables.dense_state(model.state_dict()), meta)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    got = checkpoints.load_sharded(checkpoints.recover(path), tables.dense_state(model.state_dict()))
    loaded = tables.full_state(tables.dense_state(model.state_dict()), rank)
    same = all(torch.equal(loaded[k], trained[k]) for k in trained)
    dense.unwrap()
    dense.destroy()
    return trained, same, got["step"], refused, type(ddp).__name__


def test_the_plain_objects_train_and_checkpoint_without_a_trainer(tmp_path):
    want = reference(2, steps=2)
    for trained, same, step, refused, wrapper in run_ranks(plain_loop, 2, str(tmp_path / "ckpt")):
        for k in want:
            torch.testing.assert_close(trained[k], want[k], **TOL, msg=k)
        assert same and step == 2
        assert wrapper == "DistributedDataParallel"
        assert refused is not None and "loss" in refused


def test_failure_handling_names_the_rank_and_ends_the_launched_ranks(monkeypatch, capsys):
    from lightning_shardrec.lightning.failures import rank_failures

    exits: list[int] = []
    killed: list[bool] = []
    monkeypatch.setattr(rank_failures.os, "_exit", exits.append)
    failures = rank_failures.FailureHandling(heartbeat_timeout=None, kill=lambda: killed.append(True))
    failures.on_dead_rank(1, "stopped (no heartbeat for 4.0 s)")
    assert killed == [True] and exits == [1]
    assert "rank 1 stopped (no heartbeat for 4.0 s). Rank 0 exits." in capsys.readouterr().out
    failures.on_exception(ValueError("bad"))  # no monitor (one rank): marked failing, nothing to report
    assert failures.failing
