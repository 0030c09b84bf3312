"""TorchRec's planner value types (``torchrec.distributed.planner.types``), with its fields and rules.

``Storage`` and ``Shard`` describe capacities and shards; ``TrainerConfig``, ``HardwareConfig`` and
``KernelConfig`` carry what TorchRec's ``TopologyFactory`` merges into a topology (here a
:class:`~lightning_shardrec.planner.Topology` is built directly: :func:`topology_from_configs`
does the merge for the fields that exist here). :func:`hash_planner_context_inputs` fingerprints a
planner's inputs, so a stored plan can be reused while they stay the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.planner import ParameterConstraints, Topology
from lightning_shardrec.planner.machine.topology import ComputeDevice

#: TorchRec's backward/forward compute ratio (its planner constant BWD_COMPUTE_MULTIPLIER)
BWD_COMPUTE_MULTIPLIER = 2.0
WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER = 1.0


@dataclass(repr=True, order=True, eq=True)
class Storage:
    """Bytes of device memory (``hbm``), host memory (``ddr``) and disk (``ssd``)."""

    hbm: int
    ddr: int
    ssd: int = 0

    def __add__(self, other: Storage) -> Storage:
        return Storage(hbm=self.hbm + other.hbm, ddr=self.ddr + other.ddr, ssd=self.ssd + other.ssd)

    def __sub__(self, other: Storage) -> Storage:
        return Storage(hbm=self.hbm - other.hbm, ddr=self.ddr - other.ddr, ssd=self.ssd - other.ssd)

    def __hash__(self) -> int:
        return hash((self.hbm, self.ddr, self.ssd))

    def fits_in(self, other: Storage) -> bool:
        """Every kind of memory is within ``other``'s."""
        return self.hbm <= other.hbm and self.ddr <= other.ddr and self.ssd <= other.ssd


@dataclass
class Shard:
    """A rectangle of a table: ``size`` (rows, cols) at ``offset`` (row, col), its storage, perf and rank."""

    size: list[int]
    offset: list[int]
    storage: Storage | None = None
    perf: Any = None
    rank: int | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.size), tuple(self.offset), self.storage, self.perf, self.rank))

    def __str__(self) -> str:
        return (
            f"Shard size: {tuple(self.size)}, offset: {tuple(self.offset)}, storage: {self.storage}, "
            f"perf: {self.perf}, rank: {self.rank}"
        )


@dataclass(frozen=True)
class _ConfigBase:
    additional_params: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def get_param(self, key: str, default: Any = None) -> Any:
        return self.additional_params.get(key, default)

    def has_param(self, key: str) -> bool:
        return key in self.additional_params


@dataclass(frozen=True)
class TrainerConfig(_ConfigBase):
    """What the training job sets (highest precedence): world size, ranks per host, capacities."""

    world_size: int | None = None
    local_world_size: int | None = None
    hbm_cap_bytes: int | None = None
    ddr_cap_bytes: int | None = None
    ssd_cap_bytes: int | None = None
    is_dry_run: bool = False
    dry_run_hbm_bytes: int | None = None
    dry_run_ddr_bytes: int | None = None
    pod_size: int | None = None

    def validate(self) -> None:
        if self.world_size is None:
            raise ValueError("world_size must be provided in TrainerConfig")
        if self.pod_size is not None and self.pod_size > self.world_size:
            raise ValueError(f"pod_size ({self.pod_size}) cannot be greater than world_size ({self.world_size})")


@dataclass(frozen=True)
class HardwareConfig(_ConfigBase):
    """What the hardware has: capacities (bytes) and bandwidths (bytes/ms)."""

    hbm_cap_bytes: int | None = None
    ddr_cap_bytes: int | None = None
    ssd_cap_bytes: int | None = None
    intra_host_bw: float | None = None
    inter_host_bw: float | None = None
    hbm_mem_bw: float | None = None
    ddr_mem_bw: float | None = None
    hbm_to_ddr_mem_bw: float | None = None
    ssd_mem_bw: float | None = None

    def get_validation_issues(self, compute_device: str | None = None) -> list[str]:
        """Values that cannot be right (non-positive capacities or bandwidths; intra- below inter-host)."""
        issues: list[str] = []
        if self.hbm_cap_bytes is not None and compute_device in ("cuda", "mtia") and self.hbm_cap_bytes <= 0:
            issues.append(f"hbm_cap_bytes={self.hbm_cap_bytes} is non-positive")
        if self.ddr_cap_bytes is not None and self.ddr_cap_bytes <= 0:
            issues.append(f"ddr_cap_bytes={self.ddr_cap_bytes} is non-positive")
        if self.ssd_cap_bytes is not None and self.ssd_cap_bytes < 0:
            issues.append(f"ssd_cap_bytes={self.ssd_cap_bytes} is negative")
        for name in ("intra_host_bw", "inter_host_bw", "hbm_mem_bw", "ddr_mem_bw", "hbm_to_ddr_mem_bw", "ssd_mem_bw"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                issues.append(f"{name}={value} is non-positive")
        intra, inter = self.intra_host_bw, self.inter_host_bw
        if intra is not None and inter is not None and intra < inter:
            issues.append(
                f"intra_host_bw ({intra:.0f}) < inter_host_bw ({inter:.0f}); intra-node bandwidth is "
                "typically much higher than inter-node"
            )
        return issues

    def validate(self, compute_device: str | None = None) -> None:
        """Warns (never raises) with every issue, as TorchRec does."""
        import warnings

        issues = self.get_validation_issues(compute_device)
        if issues:
            warnings.warn("HardwareConfig validation: " + "; ".join(issues), stacklevel=2)


@dataclass(frozen=True)
class KernelConfig(_ConfigBase):
    """The compute device and the cost model's multipliers."""

    compute_device: str = "cuda"
    bwd_compute_multiplier: float = BWD_COMPUTE_MULTIPLIER
    weighted_feature_bwd_compute_multiplier: float = WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER
    uneven_sharding_perf_multiplier: float = 1.0
    use_hardware_based_bandwidth: bool = False
    generalized_comms_bandwidths: Any = None

    def validate(self) -> None:
        if self.compute_device not in ("cuda", "cpu", "mtia"):
            raise ValueError(f"compute_device must be one of cuda, cpu, mtia; got {self.compute_device!r}")
        if self.bwd_compute_multiplier <= 0:
            raise ValueError(f"bwd_compute_multiplier must be positive, got {self.bwd_compute_multiplier}")


def topology_from_configs(
    trainer: TrainerConfig, hardware: HardwareConfig | None = None, kernel: KernelConfig | None = None
) -> Topology:
    """A :class:`Topology` from TorchRec's three configs (trainer values over hardware ones; bandwidths in
    TorchRec's bytes/ms, stored here as bytes/s); ``mtia``,
    SSD capacities and custom bandwidth models have no counterpart here and are refused by name."""
    trainer.validate()
    hardware, kernel = hardware or HardwareConfig(), kernel or KernelConfig()
    kernel.validate()
    if kernel.compute_device == "mtia" or kernel.generalized_comms_bandwidths is not None:
        what = "compute_device='mtia'" if kernel.compute_device == "mtia" else "generalized_comms_bandwidths"
        raise UnsupportedFeatureError(f"KernelConfig({what}) is not supported: the planner here plans cpu or cuda")
    hbm = trainer.dry_run_hbm_bytes if trainer.is_dry_run and trainer.dry_run_hbm_bytes else trainer.hbm_cap_bytes
    ddr = trainer.dry_run_ddr_bytes if trainer.is_dry_run and trainer.dry_run_ddr_bytes else trainer.ddr_cap_bytes

    def per_s(bytes_per_ms: float | None) -> float | None:
        return None if bytes_per_ms is None else bytes_per_ms * 1000.0

    return Topology(
        world_size=int(trainer.world_size),  # type: ignore[arg-type]
        compute_device=ComputeDevice(kernel.compute_device),
        local_world_size=trainer.local_world_size,
        hbm_cap=hbm or hardware.hbm_cap_bytes,
        ddr_cap=ddr or hardware.ddr_cap_bytes,
        hbm_bw=per_s(hardware.hbm_mem_bw),
        ddr_bw=per_s(hardware.ddr_mem_bw),
        intra_host_bw=per_s(hardware.intra_host_bw),
        inter_host_bw=per_s(hardware.inter_host_bw),
    )


def hash_sha256_to_int(hashable_list: list[Any]) -> int:
    """SHA-256 of ``str(hashable_list)``, as an int (TorchRec's fingerprint)."""
    return int(hashlib.sha256(str(hashable_list).encode("utf-8")).hexdigest(), 16)


def hash_planner_context_inputs(
    topology: Topology,
    batch_size: int,
    enumerator: Any = None,
    storage_reservation: Any = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    hash_function: Callable[[list[Any]], int] = hash_sha256_to_int,
) -> int:
    """A fingerprint of what a plan depends on: the topology, the batch size, the topology a storage reservation
    left (as TorchRec's: after its ``reserve``) and the constraints (in table order). The planner's enumerator is
    built in here: ``enumerator`` must be None."""
    if enumerator is not None:
        raise UnsupportedFeatureError(
            f"hash_planner_context_inputs(enumerator={type(enumerator).__name__}): the planner's enumerator is "
            "built in here; pass enumerator=None"
        )
    reserved = None
    if storage_reservation is not None:
        reserved = getattr(storage_reservation, "last_reserved_topology", None)
        if reserved is None:
            raise ValueError(
                f"hash_planner_context_inputs: {type(storage_reservation).__name__} has reserved nothing yet; "
                "call its reserve(...) (or plan with it) before hashing"
            )
    items = sorted((constraints or {}).items())
    return hash_function([repr(topology), batch_size, repr(reserved), [(name, repr(c)) for name, c in items]])


__all__ = [
    "HardwareConfig",
    "KernelConfig",
    "Shard",
    "Storage",
    "TrainerConfig",
    "hash_planner_context_inputs",
    "hash_sha256_to_int",
    "topology_from_configs",
]
