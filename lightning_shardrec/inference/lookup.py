"""The two lookup backends of :class:`QuantEmbeddingBagCollection`.

Both read the same stored rows (:class:`~lightning_shardrec.inference.rowwise.QuantizedRows`
per table) and return SUM-pooled bags ``[B, sum of feature dims]`` in feature order;
the collection applies MEAN on top, so both backends pool identically.

* :class:`TorchQuantLookup` gathers the bag's rows, dequantizes only those
  (``scale * q + bias``) and sums them with ``F.embedding_bag``: runs anywhere.
* :class:`FbgemmQuantLookup` hands the rows to fbgemm's
  ``IntNBitTableBatchedEmbeddingBagsCodegen`` (one TBE for all tables, fp32 out),
  which dequantizes inside its kernel. After building it, the collection's buffers
  are re-pointed at the TBE's own storage, so the rows exist once in memory and a
  later ``load_state_dict`` writes straight into the kernel's table.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_shardrec import _fbgemm
from lightning_shardrec.errors import unknown_name
from lightning_shardrec.inference.rowwise import QuantDType, QuantizedRows, dequantize_rows
from lightning_shardrec.sparse import KeyedJaggedTensor


class QuantBackend(enum.Enum):
    """Which kernel serves the lookups; AUTO = fbgemm where its CPU ops load, torch otherwise."""

    AUTO = "auto"
    FBGEMM = "fbgemm"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: str | QuantBackend) -> QuantBackend:
        if isinstance(value, QuantBackend):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise unknown_name("quantized lookup backend", value, [m.value for m in cls]) from None

    def resolve(self, device: torch.device) -> QuantBackend:
        """AUTO -> the concrete backend for tables on ``device``."""
        fbgemm_ok = _fbgemm.fbgemm_inference_available() and device.type == "cpu"
        if self is QuantBackend.AUTO:
            return QuantBackend.FBGEMM if fbgemm_ok else QuantBackend.TORCH
        if self is QuantBackend.FBGEMM and not fbgemm_ok:
            raise ValueError(
                f"backend='fbgemm' needs fbgemm_gpu's CPU inference TBE for tables on {device}; "
                f"fbgemm available: {_fbgemm.fbgemm_inference_available()}. Use backend='torch' or 'auto'"
            )
        return self


class QuantLookup(Protocol):
    """``lookup(kjt in feature order) -> [B, sum dims]`` SUM-pooled, float32."""

    def __call__(self, kjt: KeyedJaggedTensor, weights: Tensor | None) -> Tensor: ...


class TorchQuantLookup:
    """Dequantize-on-lookup in plain torch: one gather + ``embedding_bag`` per table."""

    def __init__(self, rows: Sequence[QuantizedRows], features_per_table: Sequence[int]) -> None:
        self._rows = list(rows)
        self._features = list(features_per_table)

    def __call__(self, kjt: KeyedJaggedTensor, weights: Tensor | None) -> Tensor:
        out = []
        subs = kjt.split(self._features)
        for rows, nf, sub in zip(self._rows, self._features, subs, strict=True):
            ids = sub.values().long()
            gathered = dequantize_rows(
                rows.dtype,
                rows.data[ids],
                None if rows.scale is None else rows.scale[ids],
                None if rows.bias is None else rows.bias[ids],
            )
            pooled = F.embedding_bag(
                torch.arange(ids.numel(), device=ids.device),
                gathered,
                sub.offsets().long(),
                mode="sum",
                per_sample_weights=sub.weights().float() if weights is not None else None,
                include_last_offset=True,
            )  # [nf * B, dim], key-major
            batch = sub.stride()
            out.append(pooled.view(nf, batch, -1).transpose(0, 1).reshape(batch, -1))
        return torch.cat(out, dim=1)


class FbgemmQuantLookup:
    """fbgemm's integer TBE over all tables at once (CPU, fp32 output, SUM pooling)."""

    def __init__(
        self,
        names: Sequence[str],
        rows: Sequence[QuantizedRows],
        features_per_table: Sequence[int],
        *,
        bounds_check: bool,
    ) -> None:
        inf = _fbgemm.fbgemm_inference_tbe()
        sparse_type = {
            QuantDType.INT8: inf.SparseType.INT8,
            QuantDType.INT4: inf.SparseType.INT4,
            QuantDType.FP16: inf.SparseType.FP16,
        }
        specs = [
            (name, r.data.shape[0], _dim(r), sparse_type[r.dtype], inf.EmbeddingLocation.HOST)
            for name, r in zip(names, rows, strict=True)
        ]
        feature_table_map = [t for t, n in enumerate(features_per_table) for _ in range(n)]
        check = inf.BoundsCheckMode.FATAL if bounds_check else inf.BoundsCheckMode.NONE
        self.tbe = inf.IntNBitTableBatchedEmbeddingBagsCodegen(
            specs,
            feature_table_map=feature_table_map,
            pooling_mode=inf.PoolingMode.SUM,
            device="cpu",
            bounds_check_mode=check,
            output_dtype=inf.SparseType.FP32,
        )
        self.tbe.initialize_weights()
        self.tbe.assign_embedding_weights(
            [(_as_bytes(r.data), None if r.scale is None else _scale_bias_bytes(r)) for r in rows]
        )

    def stored_rows(self, dtypes: Sequence[QuantDType]) -> list[QuantizedRows]:
        """Views of the TBE's own storage, one per table (the collection's new buffers)."""
        views = self.tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=2)
        out = []
        for dtype, (data, scale, bias) in zip(dtypes, views, strict=True):
            if dtype is QuantDType.FP16:
                data = data.view(torch.float16)
            out.append(QuantizedRows(dtype=dtype, data=data, scale=scale, bias=bias))
        return out

    def __call__(self, kjt: KeyedJaggedTensor, weights: Tensor | None) -> Tensor:
        return self.tbe(kjt.values().long(), kjt.offsets().long(), None if weights is None else weights.float())


def _dim(rows: QuantizedRows) -> int:
    if rows.dtype is QuantDType.FP16:
        return int(rows.data.shape[1])
    return int(rows.data.shape[1]) * 8 // rows.dtype.bits


def _as_bytes(data: Tensor) -> Tensor:
    return data.contiguous().view(torch.uint8)


def _scale_bias_bytes(rows: QuantizedRows) -> Tensor:
    if rows.scale is None or rows.bias is None:
        raise ValueError(f"{rows.dtype.value} rows need a scale and a bias")
    return torch.cat([rows.scale, rows.bias], dim=1).contiguous().view(torch.uint8)
