"""Fused table updates under a loss scaler (``GradScaler``, ``precision="16-mixed"``).

A fused kernel updates its rows inside backward, but a scaled loss makes that gradient
``S`` times too large, and only after backward does the scaler know whether the step
overflowed (and so must be skipped). While a :class:`ScaledTableUpdates` is attached,
each kernel lookup made with grad enabled is *deferred*: the forward runs without a
graph, and backward keeps the gradient that reaches the kernel (``[B, sum D]`` pooled,
``[N, D]`` sequence) instead of applying it. After backward the step decides:

1. :meth:`found_inf`: 1.0 if any kept gradient holds NaN/inf (a 0-d tensor on the
   kernels' device; no host sync). Combine it over ranks (each holds other shards) and
   with the dense gradients' check (see :class:`~lightning_shardrec.lightning.training.precision.ScalerGlue`);
2. :meth:`apply` with the scale of that backward: each kept lookup is replayed (one extra
   lookup) and its gradient divided by the scale reaches the kernel, which updates as
   in an unscaled run (a kernel looked up several times in the step: its replays' row
   gradients are summed first, then one update); or :meth:`discard` (counted in ``skipped_steps``) when the
   scaler skips the step: the tables do not move, as the dense layers do not.

Plain PyTorch::

    updates = ScaledTableUpdates(model.fused_optimizer.kernels)
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    # (contribute updates.found_inf() to the scaler's decision, e.g. poison a dense grad)
    scaler.step(dense_opt); scaler.update()
    updates.apply(scale) if scaler.get_scale() >= scale else updates.discard()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.kernels import BatchedEmbeddingKernel, KernelBackend
from lightning_shardrec.optim.deferred_updates import DeferredTableUpdates
from lightning_shardrec.optim.repeated_lookups import repeated_lookup_error
from lightning_shardrec.sparse import KeyedJaggedTensor


class _Deferred(torch.autograd.Function):
    """The kernel's lookup without its update; backward keeps the gradient for later."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, placeholder: Tensor, owner: ScaledTableUpdates, kernel: BatchedEmbeddingKernel, kjt: Any
    ) -> Tensor:
        ctx.owner, ctx.kernel, ctx.kjt = owner, kernel, kjt
        return nn.Module.__call__(kernel, kjt)  # grad is off inside forward: no update will follow

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.owner._pending.append((ctx.kernel, ctx.kjt, grad))
        return (None,) * 4


def _repeated(kernels: list[BatchedEmbeddingKernel]) -> dict[int, BatchedEmbeddingKernel]:
    """The kernels that occur more than once in ``kernels`` (by id); an fbgemm one cannot be summed."""
    seen: set[int] = set()
    out: dict[int, BatchedEmbeddingKernel] = {}
    for k in kernels:
        if id(k) in seen:
            if k.backend is not KernelBackend.TORCH:
                raise repeated_lookup_error(k, f"the {k.backend.value} kernel cannot sum its replays")
            out[id(k)] = k
        seen.add(id(k))
    return out


class ScaledTableUpdates:
    """Defers ``kernels``' fused updates until :meth:`apply` / :meth:`discard` (module docstring)."""

    def __init__(self, kernels: Sequence[BatchedEmbeddingKernel]) -> None:
        self.kernels = list(kernels)
        self._pending: list[tuple[BatchedEmbeddingKernel, KeyedJaggedTensor, Tensor]] = []
        #: steps whose table updates were dropped because the scaler skipped them
        self.skipped_steps = 0
        for k in self.kernels:
            k.deferred = self

    @property
    def pending(self) -> int:
        """Lookups whose gradient waits for :meth:`apply` or :meth:`discard`."""
        return len(self._pending)

    def lookup(self, kernel: BatchedEmbeddingKernel, kjt: KeyedJaggedTensor) -> Tensor:
        """``kernel(kjt)`` whose update is deferred (called by the kernel while attached)."""
        placeholder = torch.empty(0, device=kjt.values().device, requires_grad=True)
        return _Deferred.apply(placeholder, self, kernel, kjt)

    def found_inf(self, device: torch.device | str = "cpu") -> Tensor:
        """0-d float32 on ``device``: 1.0 when a kept gradient holds NaN/inf, else 0.0 (no host sync)."""
        found = torch.zeros((), dtype=torch.float32, device=device)
        for _, _, grad in self._pending:
            found = torch.maximum(found, (~torch.isfinite(grad).all()).to(found.device, torch.float32))
        return found

    @torch.no_grad()
    def apply(self, scale: float | Tensor) -> None:
        """Replay the kept lookups with their gradients divided by ``scale`` (the scale of the
        backward that produced them); the kernels update as in an unscaled run."""
        pending, self._pending = self._pending, []
        repeated = _repeated([k for k, _, _ in pending])
        # a kernel looked up more than once this step: its replays' row gradients summed, then one update
        sums = DeferredTableUpdates(list(repeated.values())) if repeated else None
        for kernel, kjt, grad in pending:
            with torch.enable_grad():
                out = nn.Module.__call__(kernel, kjt)
            torch.autograd.backward(out, grad / scale)
        if sums is not None:
            clip = next(iter(repeated.values())).grad_clip_value
            if clip is not None:
                sums.clamp_(clip)
            sums.apply()
            sums.detach()

    def discard(self) -> None:
        """Drop the kept gradients: the step was skipped, the tables stay as they are."""
        if self._pending:
            self.skipped_steps += 1
        self._pending = []

    def detach(self) -> None:
        """Stop deferring: kernels update in backward again (pending gradients are dropped)."""
        for k in self.kernels:
            if k.deferred is self:
                k.deferred = None
        self._pending = []
