"""The embedding collections at TorchRec's path (``torchrec.modules.embedding_modules``)."""

from __future__ import annotations

from lightning_shardrec.errors import missing_names
from lightning_shardrec.modules.embedding_bag_collection import EmbeddingBagCollection
from lightning_shardrec.modules.embedding_collection import EmbeddingCollection

__getattr__ = missing_names(
    __name__,
    {
        "EmbeddingBagCollectionInterface": "subclass nn.Module; the collections here are concrete classes",
        "EmbeddingCollectionInterface": "subclass nn.Module; the collections here are concrete classes",
    },
)

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]
