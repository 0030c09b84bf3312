"""``EmbeddingShardingPlanner`` at TorchRec's path (``torchrec.distributed.planner.planners``)."""

from lightning_shardrec.planner import EmbeddingShardingPlanner

__all__ = ["EmbeddingShardingPlanner"]
