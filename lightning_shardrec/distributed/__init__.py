"""Sharded embedding collections and ``DistributedModelParallel``."""

from lightning_shardrec.distributed.comm import ShardingEnv
from lightning_shardrec.distributed.embedding import ShardedEmbeddingCollection
from lightning_shardrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from lightning_shardrec.distributed.model_parallel import DistributedModelParallel, find_collections
from lightning_shardrec.distributed.sharders import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ModuleSharder,
)
from lightning_shardrec.distributed.train_pipeline import TrainPipelineSparseDist

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
