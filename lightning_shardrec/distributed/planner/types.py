"""Planner types at TorchRec's path (``torchrec.distributed.planner.types``)."""

from __future__ import annotations

from lightning_shardrec.errors import PlannerError, missing_names
from lightning_shardrec.planner import ParameterConstraints, Topology

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
            "StorageReservation",
            "Stats",
            "ShardingOption",
            "Shard",
            "Storage",
            "Perf",
            "PlannerErrorType",
        )
    },
)

__all__ = ["ParameterConstraints", "PlannerError", "Topology"]
