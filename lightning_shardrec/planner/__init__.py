"""Sharding planner: topology, constraints, cost model, partitioner, plans.

Pure: plans for a pretend world size from table configs; ``collective_plan`` is the
only part that talks to a process group.
"""

from lightning_shardrec.planner.costs.perf import Workload, shard_perf
from lightning_shardrec.planner.costs.storage import shard_storage
from lightning_shardrec.planner.machine.rates import Rates, step_estimate
from lightning_shardrec.planner.machine.topology import DEVICE_DEFAULTS, ComputeDevice, Topology
from lightning_shardrec.planner.plans.sharding_plan import (
    EmbeddingModuleShardingPlan,
    ModuleShardingPlan,
    PlanStats,
    ShardingPlan,
)
from lightning_shardrec.planner.plans.types import (
    EmbeddingComputeKernel,
    ParameterConstraints,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.planner.plans.validate import sharding_problems
from lightning_shardrec.planner.search.collective import collective_plan
from lightning_shardrec.planner.search.planner import EmbeddingShardingPlanner

__all__ = [
    "DEVICE_DEFAULTS",
    "ComputeDevice",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EmbeddingShardingPlanner",
    "ModuleShardingPlan",
    "ParameterConstraints",
    "ParameterSharding",
    "PlanStats",
    "Rates",
    "ShardMetadata",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "Workload",
    "collective_plan",
    "shard_perf",
    "shard_storage",
    "sharding_problems",
    "step_estimate",
]
