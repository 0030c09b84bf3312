"""TorchRec's quantization settings read into this library's: storage types from a
``QuantConfig`` (or torch ``QConfig``) as ``torch.quantization.quantize_dynamic`` leaves it on a module.

TorchRec's weight dtypes map to the tables here: ``torch.qint8`` / ``torch.quint8`` / ``torch.int8``
-> int8, ``torch.quint4x2`` -> int4, ``torch.float16`` -> fp16 (row-wise, fp16 scale and bias per row,
TorchRec's layout). Others (fp32, bf16, int2, fp8) and outputs other than fp32 raise
:class:`~lightning_shardrec.errors.UnsupportedFeatureError` naming the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.inference.rowwise import QuantDType

#: TorchRec's weight dtypes -> the tables' storage type here
WEIGHT_DTYPES: Mapping[torch.dtype, QuantDType] = {
    torch.qint8: QuantDType.INT8,
    torch.quint8: QuantDType.INT8,
    torch.int8: QuantDType.INT8,
    torch.quint4x2: QuantDType.INT4,
    torch.float16: QuantDType.FP16,
}
_VALID = "torch.qint8, torch.quint8, torch.int8 (int8), torch.quint4x2 (int4), torch.float16 (fp16)"


def _observed_dtype(factory: Any, what: str, where: str) -> torch.dtype:
    dtype = getattr(factory() if callable(factory) else factory, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: the qconfig's {what} gives no dtype (got {factory!r}); use an observer factory")
    return dtype


def weight_dtype(dtype: torch.dtype, table: str, where: str) -> QuantDType:
    """The storage type for TorchRec's weight ``dtype`` of ``table``."""
    try:
        return WEIGHT_DTYPES[dtype]
    except KeyError:
        raise UnsupportedFeatureError(
            f"{where}: table '{table}' asks for weight dtype {dtype}; supported: {_VALID}"
        ) from None


def storage_of(qconfig: Any, tables: list[str], where: str) -> QuantDType:
    """The one storage type ``qconfig`` gives ``tables`` (its ``weight``, per-table overrides applied);
    the output dtype must be fp32. One type per collection here: different ones raise, naming them."""
    output = _observed_dtype(qconfig.activation, "activation", where)
    if output != torch.float32:
        raise UnsupportedFeatureError(
            f"{where}: output dtype {output} is not supported; the quantized lookups return torch.float32 "
            "(cast the output if you need another type)"
        )
    default = _observed_dtype(qconfig.weight, "weight", where)
    per_table = getattr(qconfig, "per_table_weight_dtype", None) or {}
    chosen = {t: weight_dtype(per_table.get(t, default), t, where) for t in tables}
    kinds = sorted({q.value for q in chosen.values()})
    if len(kinds) > 1:
        lines = ", ".join(f"{t}: {q.value}" for t, q in chosen.items())
        raise UnsupportedFeatureError(
            f"{where}: the tables of one collection would be stored as {kinds} ({lines}); one storage type "
            "per collection is supported here: put tables of another type in their own EmbeddingBagCollection"
        )
    return chosen[tables[0]] if tables else weight_dtype(default, "?", where)


__all__ = ["WEIGHT_DTYPES", "storage_of", "weight_dtype"]
