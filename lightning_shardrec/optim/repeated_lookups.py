"""A table looked up several times in one training step: one update on the step's summed gradient.

A fused kernel updates its rows in each lookup's backward. A model that looks the same table
up twice in one step (a two-tower model scoring positives, then negatives) would move each row
twice, each time with one lookup's gradient, where one process steps once with their sum
(``.grad`` accumulates over the lookups). :class:`RepeatedLookups` counts each kernel's lookups
made with grad enabled since :meth:`RepeatedLookups.new_step`; at a kernel's second one, before
any of the step's backward ran::

    kernel.row_sink set (updates deferred)   nothing to do: DeferredTableUpdates sums every lookup
    kernel.deferred set (loss scaler)        nothing to do: ScaledTableUpdates sums a kernel's lookups
    torch kernel, updating in backward       ``on_repeat()``: the owner defers the updates to the
                                             optimizer step (DeferredTableUpdates), from this step on
    fbgemm kernel                            RepeatedLookupError: its TBE updates inside each
                                             lookup's backward, nothing can sum them

Plain PyTorch::

    repeats = RepeatedLookups(kernels, on_repeat=lambda: ...)  # e.g. attach DeferredTableUpdates
    for batch in loader:
        repeats.new_step()
        loss_of(batch).backward(); opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_shardrec.errors import RepeatedLookupError
from lightning_shardrec.kernels import BatchedEmbeddingKernel, KernelBackend


def repeated_lookup_error(kernel: Any, why: str) -> RepeatedLookupError:
    """The error for a second lookup of ``kernel``'s tables in one step that cannot be summed (``why``)."""
    names = sorted({t.name.split("[")[0] for t in kernel.tables})  # a shard's name: "item[0:40, 0:8]"
    return RepeatedLookupError(
        f"tables {names} were looked up a second time in one training step (a model calling its embedding "
        f"module more than once, e.g. positives then negatives) and {why}: each lookup's backward would move "
        "the rows, where one process steps once with their summed gradient. Pass ShardRecStrategy(kernel='torch') "
        "(the step's lookups are then summed before one update), or look all ids up in one call"
    )


class RepeatedLookups:
    """Counts ``kernels``' lookups per step; at a second one, ``on_repeat`` or an error (module docstring)."""

    def __init__(self, kernels: Sequence[BatchedEmbeddingKernel], on_repeat: Callable[[], None]) -> None:
        self.kernels = list(kernels)
        self.on_repeat = on_repeat
        self._counts: dict[int, int] = {}
        #: whether a kernel was looked up twice in one step (``on_repeat`` ran)
        self.repeated = False
        for k in self.kernels:
            k.lookups = self

    def new_step(self) -> None:
        """A training step starts: every kernel's count back to 0."""
        self._counts.clear()

    def seen(self, kernel: BatchedEmbeddingKernel) -> None:
        """One lookup of ``kernel`` with grad enabled (called by the kernel)."""
        count = self._counts[id(kernel)] = self._counts.get(id(kernel), 0) + 1
        if count != 2 or kernel.row_sink is not None:
            return
        if kernel.backend is not KernelBackend.TORCH:
            raise repeated_lookup_error(kernel, f"the {kernel.backend.value} kernel updates inside each backward")
        if kernel.deferred is not None:
            return
        self.repeated = True
        self.on_repeat()

    def detach(self) -> None:
        """Stop counting."""
        for k in self.kernels:
            if k.lookups is self:
                k.lookups = None
        self._counts.clear()


__all__ = ["RepeatedLookups", "repeated_lookup_error"]
