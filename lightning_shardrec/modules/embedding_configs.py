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


#: TorchRec's ``DataType`` values -> torch dtypes (``INT4``/``INT2`` are the packed quantized dtypes)
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16, "NFP8": torch.float8_e4m3fn,
    "INT64": torch.int64, "INT32": torch.int32, "INT8": torch.int8, "UINT8": torch.uint8,
    "INT4": torch.quint4x2, "INT2": torch.quint2x4,
}  # fmt: skip


def data_type_to_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype of a ``DataType`` (this library's or TorchRec's members, by value)."""
    value: object = getattr(data_type, "value", data_type)
    dtype = _TORCH_DTYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise ValueError(f"DataType {data_type} cannot be converted to dtype")
    return dtype


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
    "data_type_to_dtype",
    "pooling_type_to_str",
]
