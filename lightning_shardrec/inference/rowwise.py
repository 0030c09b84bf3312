"""Row-wise quantization of embedding tables: fbgemm's scheme, in torch and via fbgemm.

Each row of an INT8/INT4 table is stored as ``dim * bits / 8`` packed bytes plus
an fp16 ``scale`` and fp16 ``bias`` (fbgemm's "SBHalf" layout, the one its
``IntNBitTableBatchedEmbeddingBagsCodegen`` reads)::

    row     x = [-0.30, 0.00, 0.50, 0.20]           (dim 4, int4)
    bias    b = fp16(min x)            = -0.30
    scale   s = fp16((max x - b) / 15) =  0.05333
    q       round((x - b) / s) clamped to [0, 15] = [0, 6, 15, 9]
    bytes   [q0 | q1 << 4, q2 | q3 << 4] = [0x60, 0x9F]
    lookup  x^ = s * q + b

so ``|x - x^| <= s / 2`` per element: ``q`` is rounded against the *stored* ``s``
and ``b``. Only the clamped ends add fp16 rounding: the top by ``qmax * d(s)`` (``s``
rounded down), the bottom by ``d(b)`` (``b`` rounded up), where ``d(v) = max(2**-11
|v|, 2**-25)`` is half an fp16 step (``2**-25`` in the subnormal range).
:func:`row_error_bound` returns ``s/2 + qmax d(s) + d(b)`` (plus fp32 slack). A pooled
bag is off by at most the sum of its rows' bounds (times ``|weight|`` when
weighted; divided by the bag size for MEAN). FP16 rows are ``x.half()``:
``|x - x^| <= d(x)``.

:func:`quantize_rows` gives bit-identical rows from fbgemm's own quantizer and from
the torch reference here (tests check it), so a table quantized on a machine with
fbgemm serves identically on one without.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_shardrec import _fbgemm
from lightning_shardrec.errors import unknown_name


class QuantDType(enum.Enum):
    """Storage type of a quantized table (``quantize(..., dtype=...)``)."""

    INT8 = "int8"
    INT4 = "int4"
    FP16 = "fp16"

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "fp16": 16}[self.value]

    @property
    def has_scale_bias(self) -> bool:
        return self is not QuantDType.FP16

    @property
    def dim_multiple(self) -> int:
        """Row widths fbgemm accepts: the packed row (plus 4 bytes scale/bias) must be 2-byte aligned."""
        return {"int8": 2, "int4": 4, "fp16": 1}[self.value]

    def packed_bytes(self, dim: int) -> int:
        """Bytes of one stored row, scale and bias included."""
        return dim * self.bits // 8 + (4 if self.has_scale_bias else 0)

    @classmethod
    def parse(cls, value: str | QuantDType) -> QuantDType:
        if isinstance(value, QuantDType):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise unknown_name("quantized dtype", value, [m.value for m in cls]) from None


@dataclass(frozen=True, kw_only=True)
class QuantizedRows:
    """One quantized table: ``data`` uint8 ``[rows, dim*bits/8]`` (fp16 ``[rows, dim]`` for FP16),
    ``scale``/``bias`` fp16 ``[rows, 1]`` (``None`` for FP16)."""

    dtype: QuantDType
    data: Tensor
    scale: Tensor | None
    bias: Tensor | None


def quantize_rows(weight: Tensor, dtype: QuantDType, *, use_fbgemm: bool | None = None) -> QuantizedRows:
    """Quantize a ``[rows, dim]`` float table row by row (fbgemm's op when available)."""
    dtype = QuantDType.parse(dtype)
    weight = weight.detach().float().contiguous()
    if dtype is QuantDType.FP16:
        return QuantizedRows(dtype=dtype, data=weight.half(), scale=None, bias=None)
    if use_fbgemm is None:
        use_fbgemm = _fbgemm.fbgemm_inference_available() and weight.device.type == "cpu"
    if use_fbgemm:
        fused = _fbgemm.fbgemm_quantize_rows_nbit(weight, dtype.bits)
        sb = fused[:, -4:].contiguous().view(torch.float16)
        data = fused[:, :-4].contiguous()
        return QuantizedRows(dtype=dtype, data=data, scale=sb[:, :1].clone(), bias=sb[:, 1:].clone())
    return _quantize_rows_torch(weight, dtype.bits, dtype)


def _quantize_rows_torch(weight: Tensor, bits: int, dtype: QuantDType) -> QuantizedRows:
    """fbgemm's ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfRef``, vectorised."""
    qmax = (1 << bits) - 1
    lo = weight.amin(dim=1, keepdim=True)
    hi = weight.amax(dim=1, keepdim=True)
    bias = lo.half()
    lo = bias.float()
    rng = hi - lo
    scale = torch.where(rng == 0, torch.ones_like(rng), rng / qmax).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    inv = 1.0 / scale
    bad = torch.isinf(inv)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    inv = torch.where(bad, torch.ones_like(inv), inv)
    q = torch.round((weight - lo) * inv).clamp_(0, qmax).to(torch.uint8)  # round-half-even, as lrintf
    return QuantizedRows(dtype=dtype, data=pack(q, bits), scale=scale.half(), bias=bias)


def pack(q: Tensor, bits: int) -> Tensor:
    """``[rows, dim]`` ints in ``[0, 2**bits)`` -> ``[rows, dim*bits/8]`` uint8, low bits first."""
    per_byte = 8 // bits
    if per_byte == 1:
        return q.to(torch.uint8)
    q = q.to(torch.uint8).view(q.shape[0], -1, per_byte)
    out = q[..., 0].clone()
    for k in range(1, per_byte):
        out |= q[..., k] << (k * bits)
    return out


def unpack(data: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack`: ``[rows, bytes]`` uint8 -> ``[rows, bytes*8/bits]`` uint8."""
    per_byte = 8 // bits
    if per_byte == 1:
        return data
    mask = (1 << bits) - 1
    parts = [(data >> (k * bits)) & mask for k in range(per_byte)]
    return torch.stack(parts, dim=-1).flatten(1)  # no -1 view: exports with any number of rows


def dequantize_rows(dtype: QuantDType, data: Tensor, scale: Tensor | None, bias: Tensor | None) -> Tensor:
    """Stored rows (any subset, gathered) -> float32 ``[rows, dim]``: ``scale * q + bias``."""
    if dtype is QuantDType.FP16:
        return data.float()
    if scale is None or bias is None:
        raise ValueError(f"{dtype.value} rows need a scale and a bias; got scale={scale}, bias={bias}")
    return unpack(data, dtype.bits).float() * scale.float() + bias.float()


def _half_step(v: Tensor) -> Tensor:
    """Half an fp16 step at ``v``: the largest error of rounding ``v`` to fp16."""
    return torch.maximum(v.abs() * 2.0**-11, torch.full_like(v, 2.0**-25))


def row_error_bound(rows: QuantizedRows, weight: Tensor) -> Tensor:
    """Per-row bound ``[rows]`` on ``|x - x^|`` for every element (see the module docstring)."""
    mag = weight.detach().float().abs().amax(dim=1)
    slack = mag * 2.0**-20  # fp32 rounding of (x - b) * (1/s) and of s * q + b
    if rows.scale is None or rows.bias is None:
        return _half_step(mag) + slack
    scale, bias = rows.scale.float().squeeze(1), rows.bias.float().squeeze(1)
    qmax = (1 << rows.dtype.bits) - 1
    return scale / 2 + qmax * _half_step(scale) + _half_step(bias) + slack
