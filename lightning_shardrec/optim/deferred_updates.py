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
syncs with the host (:meth:`keep` does, from a window's second backward on: it appends the rows
not kept yet). Extra memory per rank: the window's unique rows x dim (fp32) and their ids (up
to 2x: the buffers grow by doubling and are kept for the next windows), and with accumulation
one int32 per row of each group (the rows' places).

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
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.kernels import BatchedEmbeddingKernel, KernelBackend
from lightning_shardrec.kernels.row_updates import write_rows


class _Kept:
    """The window's summed gradient of one kernel group: unique ``rows [U]`` and ``grad [U, D]``.

    The first backward's rows are kept as they come. From the second on, ``slot`` (one int32 per
    row of the group, -1: not kept; shared across windows) finds each row's place: a row kept
    already adds its gradient in place (``old + new``, the order of ``.grad += g``), a new one is
    appended (capacity grows 2x, and the buffers of the last window that grew are reused: amortised
    O(rows)). No sort of the window's rows per backward.
    """

    def __init__(self, kernel: Any, group: Any, rows: Tensor, grad: Tensor) -> None:
        self.kernel, self.group = kernel, group
        self._rows, self._grad, self.size = rows, grad, rows.numel()
        self.slot: Tensor | None = None  # set by add(): the group's row -> place in the window
        #: buffers an earlier window grew (``[capacity]`` ids, ``[capacity, D]``), reused when this one grows
        self.spare: tuple[Tensor, Tensor] | None = None

    @property
    def rows(self) -> Tensor:
        return self._rows[: self.size]

    @property
    def grad(self) -> Tensor:
        return self._grad[: self.size]

    def add(self, rows: Tensor, grad: Tensor, slot: Tensor) -> None:
        """Add one more backward's unique ``rows`` and ``grad``; ``slot``: the group's map (all -1 outside windows)."""
        if self.slot is None:
            self.slot = slot
            slot.index_copy_(0, self.rows, torch.arange(self.size, dtype=torch.int32, device=slot.device))
        where = slot.index_select(0, rows).long()
        held = where >= 0
        if bool(held.all()):
            _add_rows(self._grad, where, grad)
            return
        hit = held.nonzero().squeeze(1)
        _add_rows(self._grad, where.index_select(0, hit), grad.index_select(0, hit))
        new = (~held).nonzero().squeeze(1)
        end = self.size + new.numel()
        if end > self._rows.numel():
            self._grow(end)
        new_rows = rows.index_select(0, new)
        self._rows[self.size : end] = new_rows
        torch.index_select(grad, 0, new, out=self._grad[self.size : end])
        slot.index_copy_(0, new_rows, torch.arange(self.size, end, dtype=torch.int32, device=slot.device))
        self.size = end

    def _grow(self, end: int) -> None:
        """Room for ``end`` rows: the buffers an earlier window left (``spare``) when they fit, else 2x."""
        spare_rows, spare_grad = self.spare if self.spare is not None else (None, None)
        if spare_rows is not None and spare_rows.numel() >= end and spare_grad is not None:
            rows, grad = spare_rows, spare_grad
        else:
            capacity = max(2 * end, self._rows.numel() * 3 // 2)
            rows, grad = self._rows.new_empty(capacity), self._grad.new_empty(capacity, self._grad.shape[1])
        rows[: self.size] = self.rows
        grad[: self.size] = self.grad
        self._rows, self._grad, self.spare = rows, grad, None

    def release(self) -> None:
        """Reset the map's entries of this window's rows to -1 (O(kept rows)), ready for the next window."""
        if self.slot is not None:
            self.slot.index_fill_(0, self.rows, -1)

    def nbytes(self) -> int:
        return self._rows.numel() * self._rows.element_size() + self._grad.numel() * self._grad.element_size()


def _add_rows(table: Tensor, rows: Tensor, values: Tensor) -> None:
    """``table[rows] += values`` for unique ``rows``: gather, add, scatter (faster on CPU than ``index_add_``)."""
    write_rows(table, rows, table.index_select(0, rows).add_(values))


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
        self._slots: dict[tuple[int, int], Tensor] = {}
        self._spare: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # grown buffers, for the next windows
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
            self._kept[key] = kept = _Kept(kernel, group, rows, grad)
            kept.spare = self._spare.get(key)
            return
        slot = self._slots.get(key)
        if slot is None:  # one int32 per row of the group, kept for the next windows
            slot = self._slots[key] = torch.full((group.rows,), -1, dtype=torch.int32, device=rows.device)
        old.add(rows, grad, slot)

    # --- the step ------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Kernel groups with kept gradients."""
        return len(self._kept)

    def kept_bytes(self) -> int:
        """Bytes held by the kept rows and gradients (the extra memory of deferring)."""
        return sum(k.nbytes() for k in self._kept.values())

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
        kept = self._kept
        for k in kept.values():
            k.kernel.apply_rows(k.group, k.rows, k.grad)
        self._release()

    def discard(self) -> None:
        """Drop the kept gradients: the step was skipped, the tables stay as they are."""
        if self._kept:
            self.skipped_steps += 1
        self._release()

    def detach(self) -> None:
        """Stop deferring: the kernels update in backward again (kept gradients are dropped)."""
        for k in self.kernels:
            if k.row_sink is self:
                k.row_sink = None
        self._release()
        self._slots, self._spare = {}, {}

    def _release(self) -> None:
        for key, k in self._kept.items():
            k.release()
            if k.slot is not None and k.spare is None:  # it grew: keep its buffers for the next windows
                self._spare[key] = (k._rows, k._grad)
        self._kept = {}
