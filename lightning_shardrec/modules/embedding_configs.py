"""Table configs at TorchRec's path (``torchrec.modules.embedding_configs``), from :mod:`lightning_shardrec.configs`."""

from __future__ import annotations

from lightning_shardrec.configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from lightning_shardrec.errors import missing_names

#: TorchRec's name for the base class of table configs
EmbeddingTableConfig = BaseEmbeddingConfig


def pooling_type_to_str(pooling_type: PoolingType) -> str:
    """``"sum"`` / ``"mean"`` (TorchRec's spelling for the kernels)."""
    return PoolingType(pooling_type).value.lower()


__getattr__ = missing_names(
    __name__,
    {
        "QuantConfig": "quantize for serving with lightning_shardrec.inference.quantize",
        "VirtualTableConfig": "virtual (key-value) tables are not supported; size num_embeddings",
        "ShardingType": "import it from lightning_shardrec.distributed.types",
    },
)

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "EmbeddingTableConfig",
    "PoolingType",
    "pooling_type_to_str",
]
