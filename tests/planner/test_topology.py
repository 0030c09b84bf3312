"""Topology defaults per device and the constructors from a live cluster."""

import pytest

from lightning_shardrec.planner import DEVICE_DEFAULTS, ComputeDevice, Topology
from lightning_shardrec.planner.machine.topology import GiB


def test_cuda_defaults_h100_class() -> None:
    topo = Topology(16)
    assert topo.compute_device is ComputeDevice.CUDA
    assert topo.local_world_size == 16 and topo.num_hosts == 1
    assert topo.memory_cap == 80 * GiB == topo.hbm_cap
    assert topo.comm_bw == topo.intra_host_bw


def test_cpu_tables_live_in_ddr() -> None:
    topo = Topology(4, compute_device="cpu", local_world_size=2)
    assert topo.memory_cap == DEVICE_DEFAULTS[ComputeDevice.CPU].ddr_cap
    assert topo.memory_bw == topo.ddr_bw
    assert topo.num_hosts == 2 and topo.comm_bw == topo.inter_host_bw
    assert list(topo.host_ranks(1)) == [2, 3] and topo.host_of(3) == 1


def test_overrides_win() -> None:
    assert Topology(2, hbm_cap=GiB).memory_cap == GiB


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "world_size must be a positive int, got 0"),
        (
            (8,),
            {"local_world_size": 3},
            "local_world_size must be a positive int dividing world_size 8, got 3",
        ),
        ((8,), {"compute_device": "tpu"}, "unknown compute device 'tpu'; available: cpu, cuda"),
        ((8,), {"hbm_bw": -1.0}, "hbm_bw must be >= 0, got -1.0"),
        (
            (8,),
            {"hbm_cap": 0},
            "compute_device 'cuda' keeps tables in HBM; hbm_cap and hbm_bw must be > 0",
        ),
    ],
)
def test_bad_topology(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(*args, **kwargs)


class _Env:
    def world_size(self) -> int:
        return 16


def test_from_cluster_environment_reads_env_vars() -> None:
    assert (
        Topology.from_cluster_environment(_Env(), environ={"LOCAL_WORLD_SIZE": "8"}).num_hosts == 2
    )
    assert (
        Topology.from_cluster_environment(_Env(), environ={"SLURM_NNODES": "4"}).local_world_size
        == 4
    )
    assert Topology.from_cluster_environment(_Env(), environ={}).num_hosts == 1
    assert (
        Topology.from_cluster_environment(_Env(), environ={}, compute_device="cpu").compute_device
        is ComputeDevice.CPU
    )


def test_from_process_group_needs_init() -> None:
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        Topology.from_process_group()
