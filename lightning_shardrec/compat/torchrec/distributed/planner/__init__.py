"""The planner at TorchRec's path (``torchrec.distributed.planner``); defined in :mod:`lightning_shardrec.planner`."""

from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

__all__ = ["EmbeddingShardingPlanner", "ParameterConstraints", "PlannerError", "Topology"]
