"""torch.ao's dynamic int8 ``Linear`` (``quantize(..., dense=True)``) in plain aten ops, for ``torch.export``.

``torch.ao.nn.quantized.dynamic.Linear`` keeps its weights in a packed TorchScript object that
``torch.export`` cannot trace. :class:`ExportableInt8Linear` holds the same int8 weights and
computes what fbgemm's ``quantized::linear_dynamic(x, w, reduce_range=True)`` computes::

    min, max   = min(x.min(), 0), max(x.max(), 0)               over the whole input
    scale, zp  = ChooseQuantizationParams(min, max, 0, 127)     (as ATen's QuantUtils.h)
    xq         = clamp(round(x / scale) + zp, 0, 127)
    y          = (xq - zp) @ (wq - w_zp).T * (scale * w_scale) + bias   (the integer sum exact)

in float64 where fbgemm rounds once (a fused multiply-add), so the outputs equal torch.ao's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_QMAX = 127  # reduce_range=True: 7-bit activations, as torch.ao's dynamic Linear asks fbgemm for
_SMALL_SCALE = 6.1e-5  # ATen's SMALL_SCALE_THRESHOLD


class ExportableInt8Linear(nn.Module):
    """``forward(x [*, in]) -> [*, out]``: a torch.ao dynamic int8 ``Linear`` in aten ops."""

    weight: Tensor
    weight_scale: Tensor
    weight_zero_point: Tensor
    bias: Tensor

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        w = module.weight()  # type: ignore[operator]
        if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scale, zero = w.q_per_channel_scales().float(), w.q_per_channel_zero_points().double()
        else:
            scale, zero = torch.tensor([w.q_scale()], dtype=torch.float32), torch.tensor([float(w.q_zero_point())])
        self.register_buffer("weight", w.int_repr().clone())  # int8 [out, in]
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", zero.to(torch.float64))
        bias = module.bias()  # type: ignore[operator]
        self.register_buffer("bias", torch.zeros(w.shape[0]) if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])

    def forward(self, x: Tensor) -> Tensor:
        lo, hi = x.min().clamp(max=0).double(), x.max().clamp(min=0).double()
        scale = (hi - lo) / _QMAX
        bad = (scale.float() == 0) | torch.isinf(1.0 / scale.float())
        scale = torch.where(bad, torch.full_like(scale, 0.1), scale)
        small = scale < _SMALL_SCALE  # ATen widens a tiny range to the smallest scale
        amp = _SMALL_SCALE / scale
        lo, hi = (
            torch.where(small & (lo != 0), torch.where(hi == 0, -_SMALL_SCALE * _QMAX, lo * amp), lo),
            torch.where(small & (hi != 0), torch.where(lo == 0, _SMALL_SCALE * _QMAX, hi * amp), hi),
        )
        scale = torch.where(small, torch.full_like(scale, _SMALL_SCALE), scale)
        from_min, from_max = -lo / scale, _QMAX - hi / scale
        err_min, err_max = -(lo / scale).abs(), _QMAX - (hi / scale).abs()
        zero = torch.where(err_min < err_max, from_min, from_max).round().clamp(0, _QMAX)
        s = scale.float()
        xq = (torch.round(x / s) + zero.float()).clamp(0, _QMAX)
        acc = (xq.double() - zero) @ (self.weight.double() - self.weight_zero_point.unsqueeze(1)).t()
        y = acc * (s * self.weight_scale).double() + self.bias.double()
        return y.float()


def exportable_dense(module: nn.Module) -> nn.Module:
    """Swap every torch.ao dynamic int8 ``Linear`` in ``module`` for :class:`ExportableInt8Linear` (in place)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    for name, m in list(module.named_modules()):
        if isinstance(m, DynamicLinear) and name:
            parent_name, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, child, ExportableInt8Linear(m))
    return module
