"""Rank 0's SIGTERM reaches every rank without a blocking collective per step.

Lightning 2.6's training loop broadcasts rank 0's "received SIGTERM" flag before every
batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``). That broadcast blocks, so it
is one more point per step where every rank waits for the slowest: about 1 ms of a
45 ms step in the issue-10 benchmark (2 ranks, gloo). :class:`LaggedSigterm` takes its
place: the same flag, sent with an async broadcast on a process group of its own, read
one batch later, by when it has long arrived::

    batch i     wait for flag(i-1) (arrived meanwhile); stop if set   send flag(i), async
    batch i+1   wait for flag(i) ...

Even async, a gloo broadcast per step costs about 1.5 ms of a 40 ms step on two shared
cores (its worker threads compete with compute), so the flag is sent every ``every``
batches (default 4): a SIGTERM on rank 0 stops every rank at most ``every`` batches
later (1 to 4 where Lightning's check takes 1). A rank that receives the signal itself
still stops at the end of its batch (Lightning's own check, untouched).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

_LOOP_CHECK = "_broadcast_sigterm_tensor"


class LaggedSigterm:
    """Replaces the fit loop's per-batch SIGTERM broadcast by a lagged async one on ``group``.

    ``group`` spans every rank and carries nothing else. Call :meth:`install` on every
    rank (same point) when training starts, and :meth:`remove` on every rank when it ends.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, every: int = 4) -> None:
        if every < 1:
            raise ValueError(f"LaggedSigterm: every must be >= 1 batch, got {every}")
        self._every = every
        self._calls = 0
        self._trainer: Any = None
        self._group = group
        self._device = device
        self._src = dist.get_global_rank(group, 0)
        self._flag: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._loop: Any = None

    def install(self, trainer: Any) -> bool:
        """Take the place of ``trainer``'s loop check; False (nothing changed) when this Lightning has none."""
        loop = trainer.fit_loop.epoch_loop
        if not callable(getattr(type(loop), _LOOP_CHECK, None)):
            return False
        setattr(loop, _LOOP_CHECK, self)  # an instance attribute: shadows the method for this loop only
        self._trainer, self._loop = trainer, loop
        return True

    def __call__(self) -> None:
        """Before a batch: act on the flag in flight (sent one batch ago), then send this batch's
        (every ``every``-th batch)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._flag is not None and int(self._flag.item()) == 1:
                with contextlib.suppress(Exception):
                    dist.barrier(group=self._group)  # as Lightning: every rank leaves together
                raise SIGTERMException()
        self._calls += 1
        if (self._calls - 1) % self._every:
            return
        received = bool(getattr(self._trainer, "received_sigterm", False))
        self._flag = torch.tensor([int(received)], device=self._device)
        self._work = dist.broadcast(self._flag, src=self._src, group=self._group, async_op=True)

    def remove(self, wait: bool = True) -> None:
        """Give the loop its own check back; ``wait``: first finish the broadcast in flight (every rank sent it)."""
        if self._work is not None and wait:
            self._work.wait()
        self._work = None
        self._flag = None
        if self._loop is not None and _LOOP_CHECK in vars(self._loop):
            delattr(self._loop, _LOOP_CHECK)
        self._trainer = self._loop = None

    def close(self) -> None:
        """Destroy the group (after :meth:`remove`): a gloo group left to interpreter exit can abort it."""
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self._group)
