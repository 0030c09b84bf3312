"""Unsharded embedding collections and their table configs (TorchRec's names)."""

from lightning_shardrec.configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from lightning_shardrec.modules.embedding_bag_collection import EmbeddingBagCollection
from lightning_shardrec.modules.embedding_collection import EmbeddingCollection

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "PoolingType",
]
