"""Table updates deferred to the optimizer step: exact accumulation and global-norm clipping.

A fused kernel applies its rule inside backward, once per backward. One process instead
sums a table's gradient over the micro-batches of an accumulation window, may clip it
(by value, or by the norm over every parameter), and steps once. While a
:class:`DeferredTableUpdates` is attached to torch kernels, each backward hands the kernel's
per-row summed gradient (unique rows of one group of tables, on the rank that holds them)
to :meth:`DeferredTableUpdates.keep`, which adds it to what the window kept so far::

    backward 1: rows [3, 7]     grad [[a], [b]]
    backward 2: rows [7, 9]     grad [[c], [d]]
    kept:       rows [3, 7, 9]  grad [[a], [b + c], [d]]   (a table's dense gradient, row by row)

At the step: :meth:`found_inf` / :meth:`unscale_` (under a loss scaler), :meth:`sum_squares`
(this rank's part of the squared global norm: each held row once), :meth:`clamp_` /
:meth:`scale_` (value clipping, the norm's clip coefficient), then :meth:`apply` (the rule
once per group with the window's gradient) or :meth:`discard` (a skipped step). None of these
syncs with the host. Extra memory: the window's unique rows x dim (fp32) per group, per rank.

Plain PyTorch (``accumulate`` micro-batches, clip at ``max_norm``)::

    updates = DeferredTableUpdates(kernels)
    for micro in window:
        (loss_of(micro) / accumulate).backward()
    sq = updates.sum_squares()  # all_reduce(SUM) over the ranks holding the tables
    total = (torch.nn.utils.get_total_norm(dense_grads) ** 2 + sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(dense_params, max_norm, total)
    updates.scale_((max_norm / (total + 1e-6)).clamp(max=1.0))
    dense_opt.step(); updates.apply()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.kernels import BatchedEmbeddingKernel, KernelBackend
from lightning_shardrec.kernels.row_updates import accumulate_rows


@dataclass
class _Kept:
    """The window's summed gradient of one kernel group: ``rows [U]`` (unique, sorted), ``grad [U, D]``."""

    kernel: Any
    group: Any
    rows: Tensor
    grad: Tensor


class DeferredTableUpdates:
    """Keeps the torch ``kernels``' row gradients until :meth:`apply` / :meth:`discard` (module docstring)."""

    def __init__(self, kernels: Sequence[BatchedEmbeddingKernel]) -> None:
        other = sorted({k.backend.value for k in kernels if k.backend is not KernelBackend.TORCH})
        if other:
            raise ValueError(
                f"DeferredTableUpdates needs torch kernels (they hand over their row gradients), got backends {other}; "
                "rebuild them with rebuild_kernels(config, 'torch')"
            )
        self.kernels = list(kernels)
        self._kept: dict[tuple[int, int], _Kept] = {}
        #: steps whose table updates were dropped because the loss scaler skipped them
        self.skipped_steps = 0
        for k in self.kernels:
            k.row_sink = self

    # --- backward ------------------------------------------------------------------------------
    @torch.no_grad()
    def keep(self, kernel: Any, group: Any, rows: Tensor, grad: Tensor) -> None:
        """Add one backward's unique ``rows [U]`` and their summed ``grad [U, D]`` to the window."""
        key = (id(kernel), id(group))
        old = self._kept.get(key)
        if old is None:
            self._kept[key] = _Kept(kernel, group, rows, grad)
            return
        # each row at most twice: old sum first, then this backward's (the order of ``.grad += g``)
        old.rows, old.grad = accumulate_rows(
            torch.cat([old.rows, rows]), torch.cat([old.grad, grad]), num_rows=group.rows
        )

    # --- the step ------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Kernel groups with kept gradients."""
        return len(self._kept)

    def kept_bytes(self) -> int:
        """Bytes held by the kept rows and gradients (the extra memory of deferring)."""
        return sum(
            k.rows.numel() * k.rows.element_size() + k.grad.numel() * k.grad.element_size() for k in self._kept.values()
        )

    def found_inf(self, device: torch.device | str = "cpu") -> Tensor:
        """0-d float32 on ``device``: 1.0 when a kept gradient holds NaN/inf, else 0.0."""
        found = torch.zeros((), dtype=torch.float32, device=device)
        for k in self._kept.values():
            found = torch.maximum(found, (~torch.isfinite(k.grad).all()).to(found.device, torch.float32))
        return found

    @torch.no_grad()
    def unscale_(self, scale: float) -> None:
        """Multiply the kept gradients by ``1 / scale`` (as ``GradScaler.unscale_`` does to ``.grad``)."""
        inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float().item()
        for k in self._kept.values():
            k.grad.mul_(inv)

    @torch.no_grad()
    def sum_squares(self, device: torch.device | str = "cpu") -> Tensor:
        """0-d float32 on ``device``: the sum of the squared kept gradients (this rank's rows, each once)."""
        total = torch.zeros((), dtype=torch.float32, device=device)
        for k in self._kept.values():
            total = total + torch.linalg.vector_norm(k.grad).square().to(total.device)
        return total

    @torch.no_grad()
    def clamp_(self, value: float) -> None:
        """Clamp the kept gradients to ``[-value, value]`` (``clip_grad_value_`` on the tables' gradient)."""
        for k in self._kept.values():
            k.grad.clamp_(-value, value)

    @torch.no_grad()
    def scale_(self, coef: Tensor | float) -> None:
        """Multiply the kept gradients by ``coef`` (the norm's clip coefficient)."""
        for k in self._kept.values():
            k.grad.mul_(coef.to(k.grad.device) if isinstance(coef, Tensor) else coef)

    @torch.no_grad()
    def apply(self) -> None:
        """Each kernel group steps once with its window's gradient; the window starts again."""
        kept, self._kept = self._kept, {}
        for k in kept.values():
            k.kernel.apply_rows(k.group, k.rows, k.grad)

    def discard(self) -> None:
        """Drop the kept gradients: the step was skipped, the tables stay as they are."""
        if self._kept:
            self.skipped_steps += 1
        self._kept = {}

    def detach(self) -> None:
        """Stop deferring: the kernels update in backward again (kept gradients are dropped)."""
        for k in self.kernels:
            if k.row_sink is self:
                k.row_sink = None
        self._kept = {}
