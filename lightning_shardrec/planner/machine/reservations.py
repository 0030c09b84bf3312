"""TorchRec's storage reservations: the memory a rank keeps from its tables, as a smaller topology.

``EmbeddingShardingPlanner(storage_reservation=...)`` takes one in place of ``reserve=``: before
planning, ``reserve(topology, batch_size, module, sharders, constraints)`` returns the topology
left to the tables, and the planner fills that. TorchRec's two training reservations:

* :class:`FixedPercentageStorageReservation` ``(percentage)``: ``percentage`` of each rank's
  HBM (on ``cuda``, what ``reserve=percentage`` keeps);
* :class:`HeuristicalStorageReservation` ``(percentage, parameter_multiplier=6.0,
  dense_tensor_estimate=None)``: that percentage, then the dense part (its parameters times
  ``parameter_multiplier`` for gradients and optimizer state, plus its buffers, or
  ``dense_tensor_estimate`` bytes), then the inputs (8 bytes an id, 20 copies: the ids of a
  step on their way through the input distribution).

The memory is the one the tables live in: HBM on ``cuda``, DDR on ``cpu``. As TorchRec's, the
percentage applies to HBM only: on a CPU topology these reserve the dense part and the inputs
alone (``reserve=`` keeps a fraction of DDR). The same bytes left as TorchRec 1.8: ``benchmarks/torchrec_parity.py``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner.machine.memory import size_text
from lightning_shardrec.planner.machine.topology import ComputeDevice, Topology
from lightning_shardrec.planner.plans.types import ParameterConstraints

#: bytes of one id in a step's input (int64), and the copies of a step's ids TorchRec reserves
ID_BYTES = 8
INPUT_COPIES = 20


class StorageReservation(abc.ABC):
    """TorchRec's interface: ``reserve(...)`` returns the topology left to the tables (kept as
    :attr:`last_reserved_topology`)."""

    _last_reserved_topology: Topology | None = None

    @property
    def last_reserved_topology(self) -> Topology | None:
        return self._last_reserved_topology

    @abc.abstractmethod
    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: list[object],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology: ...


class FixedPercentageStorageReservation(StorageReservation):
    """``percentage`` (in ``[0, 1]``) of every rank's HBM kept from the tables (DDR: none, as TorchRec's)."""

    def __init__(self, percentage: float) -> None:
        self._percentage = _check_percentage(percentage, type(self).__name__)

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: list[object],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        self._last_reserved_topology = _with_cap(topology, _after_percentage(topology, self._percentage))
        return self._last_reserved_topology


class HeuristicalStorageReservation(StorageReservation):
    """``percentage`` of every rank's HBM, then the dense part and the inputs (module docstring)."""

    def __init__(
        self, percentage: float, parameter_multiplier: float = 6.0, dense_tensor_estimate: int | None = None
    ) -> None:
        owner = type(self).__name__
        self._percentage = _check_percentage(percentage, owner)
        multiplier = parameter_multiplier
        if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or multiplier < 0:
            raise ValueError(f"{owner}: parameter_multiplier must be a number >= 0, got {parameter_multiplier!r}")
        estimate = dense_tensor_estimate
        if estimate is not None and (isinstance(estimate, bool) or not isinstance(estimate, int) or estimate < 0):
            raise ValueError(f"{owner}: dense_tensor_estimate must be None or an int >= 0 (bytes), got {estimate!r}")
        self._parameter_multiplier = parameter_multiplier
        self._dense_tensor_estimate = dense_tensor_estimate

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: list[object],
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> Topology:
        collections = _collections(module)
        dense = self._dense_tensor_estimate or _dense_bytes(module, collections, self._parameter_multiplier)
        inputs = math.ceil(_ids_per_step(collections, batch_size, constraints or {}) * ID_BYTES) * INPUT_COPIES
        cap = _after_percentage(topology, self._percentage) - dense - inputs
        if cap <= 0:
            cut = f" - {self._percentage:.0%}" if topology.compute_device is ComputeDevice.CUDA else ""
            raise PlannerError(
                f"{type(self).__name__}(percentage={self._percentage}): nothing is left for the tables: "
                f"{size_text(topology.memory_cap)} per rank{cut} - dense part "
                f"{size_text(dense)} (parameters x {self._parameter_multiplier} + buffers, or "
                f"dense_tensor_estimate) - inputs {size_text(inputs)} (ids of a step x {INPUT_COPIES}). Lower the "
                "percentage, the parameter_multiplier or the batch size, or plan for more memory per rank"
            )
        self._last_reserved_topology = _with_cap(topology, cap)
        return self._last_reserved_topology


def check_reservation(reservation: object, reserve: float | None, owner: str) -> StorageReservation | None:
    """``reservation``, once checked: None or a :class:`StorageReservation`, not given with ``reserve``."""
    if reservation is None:
        return None
    if not isinstance(reservation, StorageReservation):
        raise TypeError(
            f"{owner}: storage_reservation must be a StorageReservation (TorchRec's "
            f"FixedPercentageStorageReservation or HeuristicalStorageReservation), got {type(reservation).__name__}"
        )
    if reserve is not None:
        raise ValueError(
            f"{owner}: pass reserve={reserve!r} or storage_reservation={type(reservation).__name__}(...), "
            "not both: each says what memory the tables may not use"
        )
    return reservation


def reserved_fraction(
    reservation: StorageReservation,
    topology: Topology,
    batch_size: int,
    tables: nn.Module | Mapping[str, Sequence[BaseEmbeddingConfig]],
    constraints: Mapping[str, ParameterConstraints],
) -> float:
    """The fraction of each rank's memory ``reservation`` keeps from the tables of ``tables`` (a module, or
    module path -> table configs: a plan on paper, with no dense part)."""
    module = tables if isinstance(tables, nn.Module) else _TableConfigs(tables)
    left = reservation.reserve(topology, batch_size, module, [], constraints)
    cap = topology.memory_cap
    if not isinstance(left, Topology) or left.world_size != topology.world_size or not 0 < left.memory_cap <= cap:
        got = left.memory_cap if isinstance(left, Topology) else type(left).__name__
        raise ValueError(
            f"{type(reservation).__name__}.reserve must return a Topology of the same {topology.world_size} ranks "
            f"with 1 to {cap} bytes per rank left for the tables; got {got!r}"
        )
    return 1.0 - left.memory_cap / cap


class _TableConfigs(nn.Module):
    """Table configs alone as a module a reservation reads."""

    def __init__(self, tables: Mapping[str, Sequence[BaseEmbeddingConfig]]) -> None:
        super().__init__()
        self._configs = [c for configs in tables.values() for c in configs]

    def embedding_configs(self) -> list[BaseEmbeddingConfig]:
        return self._configs


def _check_percentage(percentage: object, owner: str) -> float:
    if isinstance(percentage, bool) or not isinstance(percentage, (int, float)) or not 0 <= percentage <= 1:
        raise ValueError(f"{owner}: percentage must be a number in [0, 1], got {percentage!r}")
    return float(percentage)


def _after_percentage(topology: Topology, percentage: float) -> int:
    """Bytes per rank left after ``percentage`` of HBM (TorchRec's rule: DDR keeps all of it)."""
    if topology.compute_device is ComputeDevice.CUDA:
        return int((1 - percentage) * topology.memory_cap)
    return topology.memory_cap


def _with_cap(topology: Topology, cap: int) -> Topology:
    """``topology`` with ``cap`` bytes per rank in the memory its tables live in."""
    if topology.compute_device is ComputeDevice.CUDA:
        return dataclasses.replace(topology, hbm_cap=cap)
    return dataclasses.replace(topology, ddr_cap=cap)


def _collections(module: nn.Module) -> list[nn.Module]:
    """The embedding collections of ``module`` (what the planner plans: the outermost with table configs)."""
    found: list[nn.Module] = []
    inside: set[nn.Module] = set()
    for sub in module.modules():  # parents before children
        has_tables = any(callable(getattr(sub, m, None)) for m in ("embedding_bag_configs", "embedding_configs"))
        if has_tables and sub not in inside:
            found.append(sub)
            inside.update(sub.modules())
    return found


def _module_bytes(module: nn.Module, multiplier: float) -> float:
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return multiplier * params + sum(b.numel() * b.element_size() for b in module.buffers())


def _dense_bytes(module: nn.Module, collections: Iterable[nn.Module], multiplier: float) -> int:
    """``module``'s parameters x ``multiplier`` plus its buffers, less its collections' (TorchRec's rule)."""
    return round(_module_bytes(module, multiplier) - sum(_module_bytes(c, multiplier) for c in collections))


def _ids_per_step(
    collections: Iterable[nn.Module], batch_size: int, constraints: Mapping[str, ParameterConstraints]
) -> float:
    """Ids of one step on a rank: per table, its pooling factors (one per feature; 1.0 without constraints)
    times the batch (the constraint's ``batch_sizes`` where given)."""
    total = 0.0
    for coll in collections:
        getter = getattr(coll, "embedding_bag_configs", None) or getattr(coll, "embedding_configs")  # noqa: B009
        for config in getter():
            pc = constraints.get(config.name)
            factors = list(pc.pooling_factors) if pc is not None else [1.0]
            sizes = list(pc.batch_sizes) if pc is not None and pc.batch_sizes else [batch_size] * len(factors)
            total += sum(f * b for f, b in zip(factors, sizes, strict=False))
    return total


__all__ = [
    "FixedPercentageStorageReservation",
    "HeuristicalStorageReservation",
    "StorageReservation",
    "check_reservation",
    "reserved_fraction",
]
