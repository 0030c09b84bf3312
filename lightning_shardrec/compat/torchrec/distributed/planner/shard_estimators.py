"""TorchRec's shard estimators' path (``torchrec.distributed.planner.shard_estimators``).

The planner here estimates storage and cost inside its own stages and does not hand out TorchRec's
``ShardingOption`` objects, which the estimators annotate; a plan's estimates are on the plan:
``plan.stats.rank_storage`` (bytes per rank) and ``plan.stats.rank_cost`` (seconds per step).
"""

from __future__ import annotations

from lightning_shardrec.errors import missing_names

_BUILT_IN = (
    "the planner's estimates are built in and read from the plan: plan.stats.rank_storage (bytes per rank) "
    "and plan.stats.rank_cost (seconds per step)"
)
__getattr__ = missing_names(
    __name__,
    {name: _BUILT_IN for name in ("EmbeddingStorageEstimator", "EmbeddingPerfEstimator", "EmbeddingOffloadStats")},
)
