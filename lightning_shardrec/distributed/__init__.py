"""Sharded embedding collections and ``DistributedModelParallel``."""

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.dmp.model_parallel import DistributedModelParallel, find_collections
from lightning_shardrec.distributed.dmp.sharders import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ModuleSharder,
)
from lightning_shardrec.distributed.pipelines.sparse_dist import TrainPipelineSparseDist
from lightning_shardrec.distributed.sharded.embedding import ShardedEmbeddingCollection
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection

__all__ = [
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "ModuleSharder",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingEnv",
    "TrainPipelineSparseDist",
    "find_collections",
]
