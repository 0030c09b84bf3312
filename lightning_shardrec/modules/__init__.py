"""Unsharded embedding collections and their table configs (TorchRec's names)."""

from lightning_shardrec.configs import (
    BaseEmbeddingConfig,
    DataType,
    DynamicConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EvictionPolicy,
    PoolingType,
)
from lightning_shardrec.modules.dynamic.hashing import bucket_of
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper, LookupResult
from lightning_shardrec.modules.dynamic.tables import optimizer_reset_hook, reset_optimizer_rows
from lightning_shardrec.modules.embedding_bag_collection import EmbeddingBagCollection
from lightning_shardrec.modules.embedding_collection import EmbeddingCollection

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "DynamicConfig",
    "DynamicIdMapper",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EvictionPolicy",
    "LookupResult",
    "PoolingType",
    "bucket_of",
    "optimizer_reset_hook",
    "reset_optimizer_rows",
]
