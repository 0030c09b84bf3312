"""The (possibly pretend) cluster the planner plans for: ranks, hosts, memory and bandwidths."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

from lightning_shardrec.planner.machine.memory import cuda_capacity, host_memory
from lightning_shardrec.planner.machine.mesh import launcher_local_world_size, mesh_layout
from lightning_shardrec.planner.machine.rates import Rates, as_rates
from lightning_shardrec.planner.plans.types import parse_enum

GiB = 1024**3


class ComputeDevice(str, enum.Enum):
    """Where tables live and lookups run: ``cpu`` (DDR) or ``cuda`` (HBM)."""

    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, kw_only=True)
class DeviceDefaults:
    """Per-device defaults (bytes, bytes/s); one place for every number. ``label`` names them."""

    label: str
    hbm_cap: int
    ddr_cap: int
    hbm_bw: float
    ddr_bw: float
    intra_host_bw: float
    inter_host_bw: float


DEVICE_DEFAULTS: dict[ComputeDevice, DeviceDefaults] = {
    # H100-class: 80 GiB HBM, ~2 TB/s effective for row gathers, NVLink, 400 Gb/s NIC per GPU.
    ComputeDevice.CUDA: DeviceDefaults(
        label="H100-class GPU",
        hbm_cap=80 * GiB,
        ddr_cap=256 * GiB,
        hbm_bw=2.0e12,
        ddr_bw=5.1e10,
        intra_host_bw=4.5e11,
        inter_host_bw=5.0e10,
    ),
    # CPU ranks: tables in DDR, gloo over shared memory / Ethernet.
    ComputeDevice.CPU: DeviceDefaults(
        label="CPU rank",
        hbm_cap=0,
        ddr_cap=64 * GiB,
        hbm_bw=0.0,
        ddr_bw=5.1e10,
        intra_host_bw=1.0e10,
        inter_host_bw=1.25e9,
    ),
}


class ClusterEnvironmentLike(Protocol):
    """What the planner reads from a Lightning ``ClusterEnvironment`` (duck-typed)."""

    def world_size(self) -> int: ...


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks, ``local_world_size`` per host (default: one host).

    Unset capacities and bandwidths take ``DEVICE_DEFAULTS[compute_device]``. On
    ``cuda`` tables live in HBM (``hbm_cap`` per rank), on ``cpu`` in DDR (``ddr_cap``).
    ``rates`` (a :class:`~lightning_shardrec.planner.machine.rates.Rates` or the path of a file
    ``benchmarks/calibrate.py`` wrote) opts in to the calibrated cost model: its bandwidths
    replace the unset ones and the per-call latencies are charged (``planner/costs/perf.py``).
    """

    world_size: int
    _: KW_ONLY
    compute_device: ComputeDevice = ComputeDevice.CUDA
    local_world_size: int | None = None
    hbm_cap: int | None = None
    ddr_cap: int | None = None
    hbm_bw: float | None = None
    ddr_bw: float | None = None
    intra_host_bw: float | None = None
    inter_host_bw: float | None = None
    rates: Rates | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ValueError(f"Topology: world_size must be a positive int, got {self.world_size!r}")
        device = parse_enum(ComputeDevice, self.compute_device, "compute device")
        object.__setattr__(self, "compute_device", device)
        local = self.world_size if self.local_world_size is None else self.local_world_size
        if not isinstance(local, int) or local <= 0 or self.world_size % local:
            raise ValueError(
                f"Topology: local_world_size must be a positive int dividing world_size "
                f"{self.world_size}, got {self.local_world_size!r}"
            )
        object.__setattr__(self, "local_world_size", local)
        defaults = DEVICE_DEFAULTS[device]
        rates = as_rates(self.rates)
        object.__setattr__(self, "rates", rates)
        if rates is not None:
            mem = "hbm_bw" if device is ComputeDevice.CUDA else "ddr_bw"
            for name, value in (
                (mem, rates.memory_bw),
                ("intra_host_bw", rates.intra_host_bw),
                ("inter_host_bw", rates.inter_host_bw),
            ):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)
        for name in ("hbm_cap", "ddr_cap", "hbm_bw", "ddr_bw", "intra_host_bw", "inter_host_bw"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, getattr(defaults, name))
            elif value < 0:
                raise ValueError(f"Topology: {name} must be >= 0, got {value!r}")
        if self.memory_cap <= 0 or self.memory_bw <= 0:
            kind = "hbm" if device is ComputeDevice.CUDA else "ddr"
            raise ValueError(
                f"Topology: compute_device {device.value!r} keeps tables in {kind.upper()}; "
                f"{kind}_cap and {kind}_bw must be > 0"
            )

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size  # type: ignore[operator]

    @property
    def memory_cap(self) -> int:
        """Bytes per rank for tables: HBM on cuda, DDR on cpu."""
        cap = self.hbm_cap if self.compute_device is ComputeDevice.CUDA else self.ddr_cap
        return int(cap)  # type: ignore[arg-type]

    @property
    def memory_bw(self) -> float:
        """Bandwidth of the memory tables live in (bytes/s)."""
        bw = self.hbm_bw if self.compute_device is ComputeDevice.CUDA else self.ddr_bw
        return float(bw)  # type: ignore[arg-type]

    @property
    def comm_bw(self) -> float:
        """Bandwidth of a collective over all ranks (inter-host once there are several hosts)."""
        bw = self.inter_host_bw if self.num_hosts > 1 else self.intra_host_bw
        return float(bw)  # type: ignore[arg-type]

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size  # type: ignore[operator]

    def host_ranks(self, host: int) -> range:
        lws = self.local_world_size
        return range(host * lws, (host + 1) * lws)  # type: ignore[operator]

    @classmethod
    def from_process_group(cls, pg: Any = None, **overrides: Any) -> Topology:
        """The live default (or given) process group: its size, device from its backend.

        On ``cuda`` with a visible GPU, ``hbm_cap`` is the current device's total memory
        (``torch.cuda.get_device_properties``) unless given; on ``cpu``, ``ddr_cap`` is this
        host's memory (:func:`~lightning_shardrec.planner.machine.memory.host_memory`) shared by the
        ranks on the host unless given; else the named default. Ranks per host (``local_world_size``) unless
        given: the launcher's, the layout :func:`~lightning_shardrec.planner.machine.mesh.host_mesh` builds
        from it (not built here: this call is not collective, so a planner may be made on one rank alone;
        the strategies pass their mesh, :meth:`from_device_mesh`).
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Topology.from_process_group: torch.distributed is not initialized; call "
                "init_process_group first, or build Topology(world_size=...) to plan on paper"
            )
        backend = str(dist.get_backend(pg)).lower()
        overrides.setdefault("compute_device", "cuda" if "nccl" in backend else "cpu")
        if parse_enum(ComputeDevice, overrides["compute_device"], "compute device") is ComputeDevice.CUDA:
            found = cuda_capacity()
            if found is not None:
                overrides.setdefault("hbm_cap", found[0])
        world = dist.get_world_size(pg)
        if "local_world_size" not in overrides:  # the launcher's: the layout the host mesh is built with
            overrides["local_world_size"] = launcher_local_world_size(world)
        if overrides["compute_device"] in (ComputeDevice.CPU, "cpu") and "ddr_cap" not in overrides:
            host = host_memory()
            if host is not None:
                overrides["ddr_cap"] = host // int(overrides["local_world_size"])
        return cls(world, **overrides)

    @classmethod
    def from_device_mesh(cls, mesh: Any, **overrides: Any) -> Topology:
        """A ``(hosts, local)`` DeviceMesh (dims ``("host", "local")``, :func:`~.mesh.host_mesh`): its size
        and ranks per host; the rest as :meth:`from_process_group` finds it (device, memory)."""
        hosts, local = mesh_layout(mesh)
        overrides["local_world_size"] = local
        topo = cls.from_process_group(**overrides)
        if topo.world_size != hosts * local:
            raise ValueError(
                f"Topology.from_device_mesh: the mesh has {hosts} x {local} ranks, the process group "
                f"{topo.world_size}; build the mesh over the default group"
            )
        return topo

    @classmethod
    def from_cluster_environment(
        cls,
        env: ClusterEnvironmentLike,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Topology:
        """A Lightning ``ClusterEnvironment``: ``world_size()``, ranks per host from env vars."""
        world = int(env.world_size())
        overrides.setdefault("local_world_size", launcher_local_world_size(world, environ))
        return cls(world, **overrides)


def local_world_size_from_env(world: int, environ: Mapping[str, str] | None = None) -> int:
    """Ranks per host from the launcher's variables (:func:`~.mesh.launcher_local_world_size`); else one host.

    Where a process group exists the layout comes from the host mesh instead (:func:`~.mesh.host_mesh`).
    """
    return launcher_local_world_size(world, environ)
