"""Reduced-precision wire format for the pooled-embedding collectives (TorchRec's "qcomms").

``comm_precision`` halves the bytes of the output all-to-alls / reduce-scatters and of
their gradients: the sender casts its fp32 buffer, the receiver casts back to fp32, and
sums (reduce-scatter) are taken in fp32 after the exchange. On the wire every reduced
format is a ``float16`` tensor (bf16 bits travel reinterpreted: an all-to-all only copies
bytes, and gloo has no int16).

* ``fp32``: unchanged (bit-exact).
* ``bf16``: fp32's range, 8 bits of mantissa (relative error <= 2^-9 per value).
* ``fp16``: 11 bits of mantissa, range 6e-8 .. 65504. Each sender scales its whole buffer
  by a power of two ``2^e`` that brings its largest magnitude to ``2^14`` (4x below fp16's
  maximum, so no value can overflow; tiny gradients move up out of the subnormals) and
  appends ``e`` to each destination's chunk; the receiver divides it out exactly.
  ``e`` is clamped to ``[-40, 40]``; an all-zero or non-finite buffer sends ``e = 0``.

::

    splits [2, 1], x = [0.5, -2.0 | 0.25], fp16: amax 2.0 -> e = 13
    wire  = fp16 [4096, -16384, 13 | 2048, 13], wire splits [3, 2]

The two directions may differ (TorchRec's ``QCommsConfig(forward_precision=FP16,
backward_precision=BF16)``): a :class:`WirePrecision` (``"fp16/bf16"``, forward/backward) sends
the pooled outputs in its ``forward`` format and their gradients in its ``backward`` format,
each rounded exactly as above.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_shardrec.errors import unknown_name

FP16_TARGET = 2.0**14  # the largest scaled magnitude: 4x headroom under fp16's 65504
MAX_EXP = 40


class CommPrecision(str, enum.Enum):
    """Precision of the pooled embeddings (forward) and their gradients (backward) on the wire."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @staticmethod
    def parse(value: CommPrecision | str) -> CommPrecision:
        """A member from itself or its value, in any case (``"BF16"``)."""
        if isinstance(value, CommPrecision):
            return value
        try:
            return CommPrecision(str(value).lower())
        except ValueError:
            raise unknown_name("comm_precision", value, [p.value for p in CommPrecision]) from None


@dataclass(frozen=True)
class WirePrecision:
    """Different wire precisions per direction: ``forward`` (pooled outputs), ``backward`` (their gradients)."""

    forward: CommPrecision
    backward: CommPrecision

    @property
    def value(self) -> str:
        """``"fp16/bf16"``: forward/backward, as :func:`parse_wire` reads it."""
        return f"{self.forward.value}/{self.backward.value}"


def parse_wire(value: CommPrecision | WirePrecision | str) -> CommPrecision | WirePrecision:
    """From a member, a :class:`WirePrecision`, ``"bf16"`` or ``"fp16/bf16"`` (forward/backward).

    One :class:`CommPrecision` when both directions agree (``"bf16/bf16"`` -> ``BF16``).
    """
    if isinstance(value, CommPrecision):
        return value
    if isinstance(value, WirePrecision):
        fwd, bwd = value.forward, value.backward
    else:
        parts = str(value).lower().split("/")
        names = [p.value for p in CommPrecision]
        if len(parts) > 2 or any(p not in names for p in parts):
            raise unknown_name("comm_precision", value, [*names, "<forward>/<backward> (e.g. fp16/bf16)"])
        fwd, bwd = CommPrecision(parts[0]), CommPrecision(parts[-1])
    return fwd if fwd is bwd else WirePrecision(fwd, bwd)


def directions(precision: CommPrecision | WirePrecision | str) -> tuple[CommPrecision, CommPrecision]:
    """``(forward, backward)`` precisions of a collective's output and of its gradient."""
    p = parse_wire(precision)
    return (p.forward, p.backward) if isinstance(p, WirePrecision) else (p, p)


def encode(x: Tensor, splits: list[int], precision: CommPrecision) -> tuple[Tensor, list[int]]:
    """1-D fp32 ``x`` cut in ``splits`` (per destination) -> ``(wire, wire splits)``."""
    if precision is CommPrecision.FP32:
        return x, splits
    if precision is CommPrecision.BF16:
        return x.to(torch.bfloat16).view(torch.float16), splits
    if splits and splits.count(splits[0]) == len(splits):  # one [W, s] block per peer: no per-peer list
        return encode_rows(x.view(len(splits), splits[0]), precision).view(-1), [s + 1 for s in splits]
    e = fp16_exponent(x)
    y = (x * torch.exp2(e)).half()
    eh = e.half().reshape(1)
    parts: list[Tensor] = []
    for part in y.split(splits):
        parts += [part, eh]
    return torch.cat(parts), [s + 1 for s in splits]


def decode(wire: Tensor, wire_splits: list[int], precision: CommPrecision) -> Tensor:
    """Inverse of :func:`encode` on the receiving side: a 1-D fp32 tensor of the payloads."""
    if precision is CommPrecision.FP32:
        return wire
    if precision is CommPrecision.BF16:
        return wire.view(torch.bfloat16).float()
    if wire_splits and wire_splits.count(wire_splits[0]) == len(wire_splits):
        return decode_rows(wire.view(len(wire_splits), wire_splits[0]), precision).view(-1)
    parts = wire.split(wire_splits)
    return torch.cat([p[:-1].float() * torch.exp2(-p[-1:].float()) for p in parts])


def encode_rows(x: Tensor, precision: CommPrecision) -> Tensor:
    """``[P, n]`` fp32, row ``p`` for peer ``p`` -> ``[P, wire_width(n)]`` wire rows, one scale for all.

    The same bits per peer as :func:`encode` with equal splits, in one buffer: the shape an
    equal all-to-all or an all-gather (``P = 1``) sends without a per-peer list.
    """
    if precision is CommPrecision.FP32:
        return x
    if precision is CommPrecision.BF16:
        return x.to(torch.bfloat16).view(torch.float16)
    e = fp16_exponent(x)
    wire = x.new_empty((x.shape[0], x.shape[1] + 1), dtype=torch.float16)
    torch.mul(x, torch.exp2(e), out=wire[:, :-1])  # scaled in fp32, rounded to fp16 once
    wire[:, -1] = e
    return wire


def decode_rows(wire: Tensor, precision: CommPrecision) -> Tensor:
    """Inverse of :func:`encode_rows` for ``[P, wire_width(n)]`` rows from ``P`` senders: ``[P, n]`` fp32."""
    if precision is CommPrecision.FP32:
        return wire
    if precision is CommPrecision.BF16:
        return wire.view(torch.bfloat16).float()
    return wire[:, :-1] * torch.exp2(-wire[:, -1:].float())


def wire_width(n: int, precision: CommPrecision) -> int:
    """The wire elements of ``n`` payload elements for one peer."""
    return n + 1 if precision is CommPrecision.FP16 else n


def wire_splits(splits: list[int], precision: CommPrecision) -> list[int]:
    """The wire element counts of ``splits`` payload elements per peer."""
    return [s + 1 for s in splits] if precision is CommPrecision.FP16 else splits


def fp16_exponent(x: Tensor) -> Tensor:
    """``e`` (0-d fp32, an integer) with ``max|x| * 2^e`` in ``(2^13, 2^14]``; 0 for zero/non-finite."""
    amax = x.abs().max() if x.numel() else x.new_zeros(())
    e = torch.floor(torch.log2(FP16_TARGET / amax.float()))
    e = torch.where(torch.isfinite(e) & (amax > 0), e, torch.zeros_like(e))
    return e.clamp(-MAX_EXP, MAX_EXP)
