"""Planner types at TorchRec's path (``torchrec.distributed.planner.types``)."""

from __future__ import annotations

from lightning_shardrec.compat.torchrec.distributed.planner.torchrec_types import (
    HardwareConfig,
    KernelConfig,
    Shard,
    Storage,
    TrainerConfig,
    hash_planner_context_inputs,
)
from lightning_shardrec.errors import PlannerError, missing_names
from lightning_shardrec.planner import ParameterConstraints, Topology
from lightning_shardrec.planner.machine.reservations import StorageReservation

_STAGES = "the planner's stages are built in; steer it with ParameterConstraints (see docs/migrating.md, 'Planner')"
__getattr__ = missing_names(
    __name__,
    {
        name: _STAGES
        for name in (
            "Enumerator",
            "Partitioner",
            "Proposer",
            "PerfModel",
            "ShardEstimator",
            "Stats",
            "ShardingOption",
            "Perf",
            "PlannerErrorType",
        )
    },
)

__all__ = [
    "HardwareConfig",
    "KernelConfig",
    "ParameterConstraints",
    "PlannerError",
    "Shard",
    "Storage",
    "StorageReservation",
    "Topology",
    "TrainerConfig",
    "hash_planner_context_inputs",
]
