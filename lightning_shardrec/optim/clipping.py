"""TorchRec's gradient clipping wrapper (``torchrec.optim.clipping``): clip, then step the wrapped optimizer.

::

    opt = GradientClippingOptimizer(KeyedOptimizerWrapper(dense_params, make_adagrad), GradientClipping.NORM, 1.0)

It clips the parameters that have gradients (``clip_grad_norm_`` / ``clip_grad_value_``, as TorchRec 1.8):
the dense ones. Embedding tables trained by a fused optimizer update inside backward and never hold a
gradient, in TorchRec and here, so clipping does not reach them; clip their updates with the fused
optimizer's own settings. Data-parallel gradients are already all-reduced when ``step()`` runs, so the
local norm is the global one.
"""

from __future__ import annotations

from enum import Enum, unique
from typing import Any

import torch
import torch.distributed as dist

from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.optim.keyed import KeyedOptimizer, OptimizerWrapper


@unique
class GradientClipping(Enum):
    NORM = "norm"
    VALUE = "value"
    NONE = "none"


class GradientClippingOptimizer(OptimizerWrapper):
    """``GradientClippingOptimizer(optimizer, clipping=NONE, max_gradient=0.1, norm_type=2.0,
    enable_global_grad_clip=False, param_to_pgs=None, track_grad_norm=False)``.

    ``last_total_grad_norm``: the norm of the gradients before the last step's clipping (NORM always;
    VALUE and NONE with ``track_grad_norm=True``), or None. Parameters on ``meta`` skip clipping.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        clipping: GradientClipping = GradientClipping.NONE,
        max_gradient: float = 0.1,
        norm_type: float | str = 2.0,
        enable_global_grad_clip: bool = False,
        param_to_pgs: dict[torch.nn.Parameter, list[dist.ProcessGroup]] | None = None,
        track_grad_norm: bool = False,
    ) -> None:
        super().__init__(optimizer)
        if enable_global_grad_clip and param_to_pgs:
            raise UnsupportedFeatureError(
                "GradientClippingOptimizer(param_to_pgs=...): parameters sharded over process groups (n-D model "
                "parallelism) are not supported; the sharded tables here update inside backward and hold no gradient"
            )
        self._clipping = GradientClipping(clipping)
        if max_gradient <= 0:
            raise ValueError(f"GradientClippingOptimizer: max_gradient must be > 0, got {max_gradient}")
        self._max_gradient = max_gradient
        self._norm_type = float(norm_type)
        self._track_grad_norm = track_grad_norm
        self._last_total_grad_norm: torch.Tensor | None = None
        self._params: list[torch.Tensor] = [p for group in self.param_groups for p in group["params"]]
        self._check_meta = True

    @property
    def last_total_grad_norm(self) -> torch.Tensor | None:
        return self._last_total_grad_norm

    def _with_grads(self) -> list[torch.Tensor]:
        return [p for p in self._params if p.grad is not None and p.grad.numel() > 0]

    def compute_total_grad_norm(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The total ``norm_type`` norm of the gradients (not clipped), and the gradients."""
        grads = [p.grad for p in self._with_grads() if p.grad is not None]
        if not grads:
            return torch.tensor(0.0), []
        return torch.nn.utils.get_total_norm(grads, self._norm_type), grads

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # TorchRec's signature
        if self._check_meta:
            if any(p.device.type == "meta" for p in self._params):
                self._last_total_grad_norm = None
                super().step(closure)
                return
            self._check_meta = False
        params = self._with_grads()
        if self._clipping == GradientClipping.NORM:
            self._last_total_grad_norm = (
                torch.nn.utils.clip_grad_norm_(params, max_norm=self._max_gradient, norm_type=self._norm_type)
                if params
                else None
            )
        else:
            if self._track_grad_norm:
                self._last_total_grad_norm = self.compute_total_grad_norm()[0]
            if self._clipping == GradientClipping.VALUE:
                torch.nn.utils.clip_grad_value_(params, clip_value=self._max_gradient)
        super().step(closure)


__all__ = ["GradientClipping", "GradientClippingOptimizer"]
