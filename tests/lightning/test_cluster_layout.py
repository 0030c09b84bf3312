"""Ranks per host come from Lightning (``num_nodes`` x ``devices``), not from launcher variables.

Four ranks on this machine play 2 nodes x 2 devices (``Trainer(num_nodes=2, devices=2)``, no
``LOCAL_WORLD_SIZE``, as under Lightning's own launcher, MPI or LSF): the plan keeps every
table-row-wise and grid table on one 2-rank host, the holders' exchange runs on 2-rank host
groups, and the weights equal the single-device run's.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
from _models import Rec, data, trainer

from lightning_shardrec.lightning.strategies.cluster import ranks_per_host
from lightning_shardrec.testing import pretend_hosts, run_ranks

STEPS = 3
BATCH = 4  # per rank
TYPES = {"mid": "grid_shard", "tiny": "row_wise"}


def two_nodes(rank, world, layout=None):
    from lightning_shardrec import ParameterConstraints, ParameterSharding, ShardRecStrategy
    from lightning_shardrec.lightning.strategies import strategy as strategy_module
    from lightning_shardrec.planner import ShardMetadata

    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "NUM_NODES", "SLURM_NNODES", "NNODES"):
        os.environ.pop(key, None)  # what Lightning's launcher, MPI and LSF leave unset
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank % 2),
        NODE_RANK=str(rank // 2),
    )
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[t], min_partition=4) for f, t in TYPES.items()}
    # pinned: t_big's two row blocks on host 1 (ranks 2, 3), summed inside the host
    blocks = [ShardMetadata((0, 0), (60, 8), 2), ShardMetadata((60, 0), (60, 8), 3)]
    pinned = {"t_big": ParameterSharding("table_row_wise", "fused", [2, 3], blocks)}
    strategy = ShardRecStrategy(constraints=constraints, plan=pinned, comm_transport="auto")  # the shm path
    t = trainer(strategy=strategy, devices=2, num_nodes=2, max_steps=STEPS)
    registered, hook = [], strategy_module.use_shm_allreduce  # the dense all-reduce's path, recorded
    strategy_module.use_shm_allreduce = lambda ddp, pg: (t := hook(ddp, pg), registered.append(t is not None))[0]
    try:
        with pretend_hosts(rank, layout) if layout else nullcontext():  # each node its own /dev/shm
            t.fit(Rec("sgd"), data(BATCH, STEPS))
    finally:
        strategy_module.use_shm_allreduce = hook
    sharded = strategy.sharded["ebc"]
    holders = {name: sorted({s.rank for s in p.shards}) for name, p in strategy.plan.get_plan_for_module("ebc").items()}
    host_sizes = sorted({g.exchange.host.world_size for g in sharded.groups if hasattr(g, "exchange")})
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    transport = type(sharded.env.transport).__name__
    return (
        (strategy.topology.num_hosts, sharded.env.local_world_size),
        holders,
        host_sizes,
        state,
        (transport, registered),
    )


@pytest.mark.parametrize(
    ("layout", "transport"),
    [(None, "ShmTransport"), pytest.param("aabb", "HostTransport", marks=pytest.mark.slow)],
)
def test_two_nodes_of_two_are_planned_and_run_as_two_hosts(layout, transport):
    results = run_ranks(two_nodes, 4, layout)
    model = Rec("sgd")
    trainer(devices=1, max_steps=STEPS).fit(model, data(BATCH * 4, STEPS))
    want = model.state_dict()
    for hosts, holders, host_sizes, state, kind in results:
        assert kind == (transport, [True])  # one /dev/shm for all, or per node and gloo between; DDP's too
        assert hosts == (2, 2)  # the planner's topology: 2 hosts; the runtime: 2 ranks per host
        assert host_sizes == [2]
        assert holders["t_big"] == [2, 3]
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    ("world", "nodes", "procs", "environ", "want"),
    [
        (8, 2, 4, {}, 4),
        (8, 1, 8, {"LOCAL_WORLD_SIZE": "2"}, 8),  # Lightning's layout wins over a stale variable
        (8, 1, 2, {"LOCAL_WORLD_SIZE": "2"}, 2),  # a group Lightning did not size: the variable
        (8, 1, 2, {}, 8),  # nothing known: one host
    ],
)
def test_ranks_per_host(monkeypatch, world, nodes, procs, environ, want):
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "NUM_NODES", "SLURM_NNODES", "NNODES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert ranks_per_host(world, nodes, procs) == want
