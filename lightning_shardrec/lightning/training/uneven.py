"""Uneven training data across ranks: a rank whose data ends early trains on with empty batches.

With per-rank ``IterableDataset`` s and streaming data the ranks' batch counts differ. Each
step of a sharded model is collective, so a rank that left the loop would hang the others.
:class:`EvenBatches` wraps each rank's training loader: every ``next()`` first agrees with
the other ranks (one all-reduce of a flag on the strategy's gloo control group, CPU tensors:
:mod:`lightning_shardrec.lightning.training.control`) whether any rank still has a
batch; a rank that has none then yields :func:`empty_like` of its last batch (the same
structure with zero rows: zero ids through every collective, zero gradient, no update from
it) until every rank's data has ended, and the epoch ends on every rank at once::

    rank 0: b0 b1 b2 b3        rank 0: b0 b1 b2 b3 |
    rank 1: c0 c1        ->    rank 1: c0 c1 ∅  ∅  |   (4 steps on both, every batch trained once)

What equals what: DDP averages the dense gradients over the ranks (``1/W Σ_r ∇L_r``) and the
tables' gradients are scaled alike, so a step equals one process whose loss is
``1/W Σ_r L_r(batch_r)`` with ``L_r(∅) = 0``. With a loss that sums over rows and divides by a
constant (``loss.sum() / B``) that is one process over the step's global batch (the rows of
every rank that had one) with ``sum / (W * B)``: exact on every step. With a mean loss, a padded
step weights each present rank's mean by ``1/W`` (as DDP does with unequal per-rank batch sizes).

A sized loader keeps a length: the longest rank's (the lengths are agreed once, when the
loader is wrapped). ``ShardRecStrategy(uneven_batches="error")`` keeps the strict mode instead:
every rank stops with :class:`~lightning_shardrec.errors.UnevenBatchesError` at the last batch
the ranks share (:mod:`lightning_shardrec.lightning.training.guards`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.lightning.training.control import ControlGroup
from lightning_shardrec.lightning.training.handover import tensors_in
from lightning_shardrec.sparse import KeyedJaggedTensor

UNEVEN_MODES = ("pad", "error")


def check_mode(mode: str) -> str:
    if mode not in UNEVEN_MODES:
        raise ValueError(f"ShardRecStrategy: uneven_batches must be one of {list(UNEVEN_MODES)}, got {mode!r}")
    return mode


def empty_like(batch: Any) -> Any:
    """``batch`` with zero rows: each tensor sliced to ``[:0]``, each KJT with its keys and no ids.

    Containers, dataclasses, named tuples and plain objects are rebuilt around the empties;
    everything else (ints, strings, ...) is kept.
    """
    if isinstance(batch, Tensor):
        return batch[:0] if batch.dim() > 0 else batch
    if isinstance(batch, KeyedJaggedTensor):
        weights = batch.weights_or_none()
        keys = batch.keys()
        return KeyedJaggedTensor(
            keys,
            batch.values()[:0],
            None if weights is None else weights[:0],
            lengths=torch.zeros(0, dtype=batch.lengths().dtype, device=batch.device()),
            stride=0,
        )
    if isinstance(batch, Mapping):
        return type(batch)({k: empty_like(v) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_like(v) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: empty_like(getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **fields)
    if hasattr(batch, "__dict__") and not callable(batch):
        out = copy.copy(batch)
        for name, value in vars(batch).items():
            setattr(out, name, empty_like(value))
        return out
    return batch


def is_empty(batch: Any) -> bool:
    """Whether ``batch`` holds tensors and every one of them has zero rows (a padded step's batch)."""
    sizes = [t.stride() if isinstance(t, KeyedJaggedTensor) else t.shape[0] for t in tensors_in(batch) if _rows(t)]
    return bool(sizes) and not any(sizes)


def _rows(t: Tensor | KeyedJaggedTensor) -> bool:
    return isinstance(t, KeyedJaggedTensor) or t.dim() > 0


def zero_loss(output: Any) -> Any:
    """A padded step's training_step output with its loss made finite (a mean over 0 rows is NaN).

    The gradient is unchanged: zero for every parameter (no row reached any of them).
    """
    if isinstance(output, Tensor):
        return torch.nan_to_num(output, nan=0.0, posinf=0.0, neginf=0.0)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": zero_loss(output["loss"])}
    return output


class BatchPadding:
    """The strategy's side: the wrapped loaders, agreeing on ``control``'s group (see the module docstring)."""

    def __init__(self, control: ControlGroup) -> None:
        self.control = control
        self.padded_steps = 0  # padded batches this rank trained on (since the strategy's setup)

    def _group(self) -> dist.ProcessGroup:
        return self.control.group()  # collective the first time: every rank wraps its loader at the same point

    def wrap(self, loader: Any) -> Any:
        """Collective: ``loader`` as is when every rank's is sized with the same length (nothing to pad, no
        cost per batch), else an :class:`EvenBatches` (sized as the longest when every rank's is sized)."""
        try:
            own = len(loader)
        except TypeError:
            own = -1  # not sized
        longest, smallest = self.longest(own), -self.longest(-own)
        if smallest >= 0 and longest == smallest:
            return loader
        return EvenBatches(loader, self, longest if smallest >= 0 else None)

    def any_left(self, have: bool) -> bool:
        """Collective: whether any rank still has a batch."""
        flag = self.control.flag(int(have))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group())
        return bool(flag.item())

    def longest(self, length: int) -> int:
        """Collective: the longest rank's loader length."""
        n = self.control.flag(length)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self._group())
        return int(n.item())


class EvenBatches:
    """A training loader whose epoch ends on every rank at the same step (empty batches past its own end).

    Attributes other than iteration (``sampler``, ``batch_sampler``, ``dataset``, ``state_dict`` ...)
    are the wrapped loader's, so Lightning still sets the sampler's epoch.
    """

    def __init__(self, loader: Any, padding: BatchPadding, length: int | None) -> None:
        self.loader = loader
        self.padding = padding
        self._length = length
        self._last: Any = None  # the last real batch (the structure a padded one copies), across epochs

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"{type(self.loader).__name__} has no length")
        return self._length

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "padding", "_length", "_last"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        ended = False
        while True:
            batch: Any = None
            if not ended:
                try:
                    batch = next(it)
                except StopIteration:
                    ended = True
            if not self.padding.any_left(not ended):
                return
            if not ended:
                self._last = batch
                yield batch
                continue
            if self._last is None:
                rank = dist.get_rank()
                raise ValueError(
                    f"ShardRecStrategy(uneven_batches='pad'): rank {rank}'s training data has yielded no batch yet "
                    "while other ranks still have batches, so there is no batch to pad with an empty one of the same "
                    "structure; give every rank at least one batch per epoch"
                )
            self.padding.padded_steps += 1
            yield empty_like(self._last)
