"""The host layout comes from one DeviceMesh ``(hosts, local)`` whatever launched the ranks (issue 41).

Four gloo ranks pretend to be 2 hosts x 2 ranks as torchrun, SLURM and Lightning's own subprocess
launcher describe them (environment variables set on each rank, restored after); each way yields the
same mesh, and the planner's topology, the sharding env and the host group all take it from there.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lightning_shardrec.lightning.strategies.cluster import ranks_per_host
from lightning_shardrec.planner import Topology
from lightning_shardrec.planner.machine.mesh import host_mesh, launcher_local_world_size, mesh_layout
from lightning_shardrec.testing import run_ranks

LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "NUM_NODES", "NNODES")
STYLES = {
    # torchrun: LOCAL_WORLD_SIZE (and LOCAL_RANK, GROUP_RANK ...)
    "torchrun": ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "{local}", "GROUP_RANK": "{host}"}, None),
    # srun: tasks per node and nodes, no LOCAL_WORLD_SIZE
    "slurm": ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_LOCALID": "{local}"}, None),
    # Lightning's subprocess launcher: LOCAL_RANK, NODE_RANK, WORLD_SIZE; the strategy knows num_nodes x devices
    "lightning": ({"LOCAL_RANK": "{local}", "NODE_RANK": "{host}", "WORLD_SIZE": "4"}, (2, 2)),
}


def _layout_under(rank: int, world: int, style: str) -> tuple:
    import torch.distributed as dist

    from lightning_shardrec.distributed.comm.collectives import ShardingEnv
    from lightning_shardrec.distributed.comm.hierarchy import host_group

    variables, lightning = STYLES[style]
    saved = {k: os.environ.get(k) for k in (*LAUNCHER_VARS, *variables)}
    try:
        for k in LAUNCHER_VARS:
            os.environ.pop(k, None)
        for k, v in variables.items():
            os.environ[k] = v.format(local=rank % 2, host=rank // 2)
        local = ranks_per_host(world, *lightning) if lightning is not None else 0  # Lightning's cluster numbers
        mesh = host_mesh(local)  # as the strategy does (lightning/strategies/strategy.py ``_shard``)
        env = ShardingEnv.from_process_group(local_world_size=mesh_layout(mesh)[1])
        host = host_group(env)
        topo = Topology.from_device_mesh(mesh, compute_device="cpu")
        bare = None  # without Lightning's numbers (DMP, shard_modules): the launcher's, through the mesh
        if lightning is None:
            bare = (ShardingEnv.from_process_group().local_world_size, Topology.from_process_group().local_world_size)
        return (
            mesh_layout(mesh),
            tuple(mesh.mesh.tolist()[rank // 2]),
            tuple(dist.get_process_group_ranks(host.pg)),
            host.pg is mesh.get_group("local"),
            env.local_world_size,
            (topo.num_hosts, topo.local_world_size),
            bare,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("style", sorted(STYLES))
def test_every_launcher_yields_the_same_mesh(style: str) -> None:
    got = run_ranks(_layout_under, 4, style)
    for rank, (layout, row, host_ranks, from_mesh, env_local, topo, bare) in enumerate(got):
        mine = [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert layout == (2, 2) and list(row) == mine and list(host_ranks) == mine
        assert from_mesh and env_local == 2 and topo == (2, 2)
        assert bare in ((2, 2), None)


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({"LOCAL_WORLD_SIZE": "4"}, 4),
        ({"SLURM_NTASKS_PER_NODE": "2"}, 2),
        ({"SLURM_NNODES": "4"}, 2),
        ({"LOCAL_WORLD_SIZE": "3"}, 8),  # does not divide 8: one host
        ({}, 8),
    ],
)
def test_launcher_local_world_size(environ: dict, want: int) -> None:
    assert launcher_local_world_size(8, environ) == want


def test_host_mesh_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"host_mesh: torch.distributed is not initialized"):
        host_mesh(2)


def _bad_local(rank: int, world: int) -> str:
    try:
        host_mesh(3)
    except ValueError as err:
        return str(err)
    return ""


def test_host_mesh_names_a_local_size_that_does_not_divide_the_world() -> None:
    errors = run_ranks(_bad_local, 2)
    assert all(
        "host_mesh: local_world_size (ranks per host) must be a positive int dividing the world size 2, got 3" in e
        for e in errors
    )


def test_mesh_layout_wants_host_and_local_dims() -> None:
    flat = SimpleNamespace(mesh_dim_names=("dp",), size=lambda dim=None: 4)
    want = r"mesh_layout: expected a 2-D DeviceMesh with mesh_dim_names \('host', 'local'\)"
    with pytest.raises(ValueError, match=want):
        mesh_layout(flat)


def _mismatch(rank: int, world: int) -> str:
    fake = SimpleNamespace(mesh_dim_names=("host", "local"), size=lambda dim: 2)  # 2 x 2 against 2 ranks
    try:
        Topology.from_device_mesh(fake, compute_device="cpu")
    except ValueError as err:
        return str(err)
    return ""


def test_from_device_mesh_refuses_a_mesh_of_another_size() -> None:
    errors = run_ranks(_mismatch, 2)
    assert all("Topology.from_device_mesh: the mesh has 2 x 2 ranks, the process group 2" in e for e in errors)


def _planner_on_rank_zero_alone(rank: int, world: int) -> int | None:
    import torch.distributed as dist

    from lightning_shardrec.planner import EmbeddingShardingPlanner
    from lightning_shardrec.planner.machine import mesh as mesh_module

    saved, saved_env = dict(mesh_module._MESHES), os.environ.get("LOCAL_WORLD_SIZE")
    mesh_module._MESHES.clear()  # no mesh built on this world yet: nothing to read it from
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # torchrun's: 2 hosts x 2
    try:
        local = None
        if rank == 0:  # a user planning on one rank (TorchRec's collective_plan does the same)
            local = EmbeddingShardingPlanner().topology.local_world_size
    finally:
        mesh_module._MESHES.update(saved)
        if saved_env is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved_env
    dist.barrier()
    return local


def test_a_planner_made_on_one_rank_alone_does_not_wait_for_the_others() -> None:
    got = run_ranks(_planner_on_rank_zero_alone, 4, timeout=60)
    assert got[0] == 2 and got[1:] == [None, None, None]  # the launcher's 2 ranks per host
