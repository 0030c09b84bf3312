"""Embedding sharding types at TorchRec's path (``torchrec.distributed.embedding_types``)."""

from __future__ import annotations

from lightning_shardrec.distributed.dmp.sharders import BaseEmbeddingSharder
from lightning_shardrec.errors import missing_names
from lightning_shardrec.planner import EmbeddingComputeKernel

__getattr__ = missing_names(
    __name__,
    {
        "GroupedEmbeddingConfig": "tables are grouped by the sharded collections themselves",
        "ShardedEmbeddingTable": "shards are described by ShardMetadata (DistributedModelParallel.local_shards())",
        "EmbeddingAttributes": "not provided",
        "KJTList": "not provided",
    },
)

__all__ = ["BaseEmbeddingSharder", "EmbeddingComputeKernel"]
