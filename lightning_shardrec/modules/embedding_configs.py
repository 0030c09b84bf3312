"""Table configs at TorchRec's path (``torchrec.modules.embedding_configs``), from :mod:`lightning_shardrec.configs`."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lightning_shardrec.configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    VirtualTableEvictionPolicy,
)
from lightning_shardrec.errors import missing_names

#: TorchRec's name for the base class of table configs
EmbeddingTableConfig = BaseEmbeddingConfig


def pooling_type_to_str(pooling_type: PoolingType) -> str:
    """``"sum"`` / ``"mean"`` (TorchRec's spelling for the kernels)."""
    return PoolingType(pooling_type).value.lower()


class QuantConfig(NamedTuple):
    """How ``quantize_dynamic`` / ``quantize_embeddings`` quantize a collection (TorchRec's fields).

    ``weight``: an observer factory whose ``().dtype`` is the tables' storage type (``torch.qint8``,
    ``torch.quint8`` or ``torch.int8``: int8; ``torch.quint4x2``: int4; ``torch.float16``: fp16).
    ``activation``: its ``().dtype`` is the lookups' output type (``torch.float`` here).
    ``per_table_weight_dtype``: table name -> storage type, overriding ``weight`` for that table.
    """

    activation: Any  # e.g. torch.quantization.PlaceholderObserver.with_args(dtype=torch.float)
    weight: Any  # e.g. torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8)
    per_table_weight_dtype: dict[str, torch.dtype] | None = None


__getattr__ = missing_names(
    __name__,
    {
        "VirtualTableConfig": "virtual (key-value) tables are not supported; size num_embeddings",
        "ShardingType": "import it from lightning_shardrec.compat.torchrec.distributed.types",
    },
)

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "EmbeddingTableConfig",
    "PoolingType",
    "QuantConfig",
    "VirtualTableEvictionPolicy",
    "pooling_type_to_str",
]
