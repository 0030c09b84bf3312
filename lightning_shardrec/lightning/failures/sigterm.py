"""SIGTERM while training: rank 0's flag reaches every rank without a blocking collective per step
(:class:`LaggedSigterm`), and a rank blocked in a collective still exits within seconds
(:class:`SigtermDeadline`).

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

The flag is a control message: a CPU tensor on the strategy's gloo control group
(:mod:`lightning_shardrec.lightning.training.control`), shared with the other control flags, so under
NCCL no communicator is made for it and no ``.item()`` reads a GPU tensor back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_shardrec.lightning.pl_compat import SIGTERM_LOOP_CHECK as _LOOP_CHECK
from lightning_shardrec.lightning.pl_compat import signal_connector, sigterm_notifier


class LaggedSigterm:
    """Replaces the fit loop's per-batch SIGTERM broadcast by a lagged async one on ``group``.

    ``group`` spans every rank: a gloo group (the flag is a CPU tensor), the strategy's control
    group (:class:`~lightning_shardrec.lightning.training.control.ControlGroup`), whose other messages
    are sent from the main thread too, in the same order on every rank. Call :meth:`install` on
    every rank (same point) when training starts, and :meth:`remove` on every rank when it ends;
    the group's owner destroys it.
    """

    def __init__(self, group: dist.ProcessGroup, every: int = 4) -> None:
        if every < 1:
            raise ValueError(f"LaggedSigterm: every must be >= 1 batch, got {every}")
        self._every = every
        self._calls = 0
        self._trainer: Any = None
        self._group = group
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
        self._flag = torch.tensor([int(received)], dtype=torch.int64)  # on the host: a gloo group
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


GRACE_ENV = "LIGHTNING_SHARDREC_SIGTERM_GRACE"
DEFAULT_GRACE = 10.0  # seconds a rank that received SIGTERM may take to leave fit on its own


class SigtermDeadline:
    """SIGTERM ends a rank within ``grace`` seconds, also one blocked in a collective.

    Lightning's SIGTERM handler runs in the main thread between bytecodes, so a rank blocked
    in a gloo or NCCL wait runs it only when the wait returns: never, when its peers wait for
    it. Lightning 2.6's handler also broadcasts on the default group, a collective inside a
    signal handler that can pair with any other collective in flight. So, while training:

    * the handler Lightning composed for SIGTERM loses that broadcast (the flag travels by
      :class:`LaggedSigterm` on its own group, as every batch already does);
    * a watcher thread learns of the signal at once through ``signal.set_wakeup_fd`` (written by
      the interpreter's C-level handler even while the main thread is blocked): it forwards the
      signal to the ranks this process launched, marks the trainer as Lightning's handler would,
      and, if the rank has not left ``fit`` (:meth:`remove`) ``grace`` seconds later, prints
      what happened, kills the launched ranks and exits with status 143 (128 + SIGTERM).

    ``grace``: ``$LIGHTNING_SHARDREC_SIGTERM_GRACE`` seconds (default 10); a healthy rank stops
    at the end of its batch, well within it. Main thread only (``install``/``remove``).
    """

    def __init__(self, rank: int, grace: float | None = None) -> None:
        if grace is None:
            text = os.environ.get(GRACE_ENV, str(DEFAULT_GRACE))
            try:
                grace = float(text)
            except ValueError:
                grace = -1.0
            if not grace > 0:
                raise ValueError(f"{GRACE_ENV} must be a number of seconds > 0, got {text!r}")
        self.rank, self.grace = rank, grace
        self._read, self._write = socket.socketpair()
        self._read.setblocking(True)
        self._write.setblocking(False)
        self._old_fd: int | None = None
        self._done = threading.Event()
        self._trainer: Any = None
        self._thread: threading.Thread | None = None
        self._handlers: tuple[list[Any], list[Any]] | None = None  # Lightning's SIGTERM handler list, as it was

    def install(self, trainer: Any) -> bool:
        """From the main thread, after Lightning registered its handlers (``on_train_start``); False where
        SIGTERM has no Python handler to wake this one (Windows, or a handler set outside Python)."""
        handler = signal.getsignal(signal.SIGTERM)
        if not callable(handler) or threading.current_thread() is not threading.main_thread():
            return False
        handlers = getattr(handler, "signal_handlers", None)
        connector = signal_connector(trainer)
        if isinstance(handlers, list) and connector is not None:  # Lightning's composition: drop the broadcast
            own = sigterm_notifier(connector)
            self._handlers = (handlers, list(handlers))  # restored by remove()
            handlers[:] = [_mark(connector) if h == own else h for h in handlers]
        self._trainer = trainer
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name=f"shardrec-sigterm-{self.rank}", daemon=True)
        self._thread.start()
        return True

    def remove(self) -> None:
        """The rank left ``fit`` (normally or by an exception): no deadline; the wakeup fd restored."""
        self._done.set()
        if self._handlers is not None:  # Lightning's composed handler list as it made it
            handlers, original = self._handlers
            handlers[:] = original
            self._handlers = None
        if self._thread is None:
            return
        with contextlib.suppress(ValueError):  # not the main thread: leave the fd to the interpreter's exit
            signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        with contextlib.suppress(OSError):
            self._write.send(b"\0")  # wake the watcher
        self._thread.join(timeout=5)
        self._thread = None
        self._read.close()
        self._write.close()

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if self._old_fd is not None and self._old_fd >= 0:  # someone else's wakeup fd: pass the bytes on
                with contextlib.suppress(OSError):
                    os.write(self._old_fd, data)
            if signal.SIGTERM in data and not self._done.is_set():
                self._on_sigterm()
                return

    def _on_sigterm(self) -> None:
        trainer = self._trainer
        launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
        connector = signal_connector(trainer)
        if launcher is not None and connector is not None and not connector.received_sigterm:
            launcher.kill(signal.SIGTERM)  # as Lightning's handler would, without waiting for the main thread
        if connector is not None:
            connector.received_sigterm = True
        if self._done.wait(self.grace):
            return
        print(
            f"lightning_shardrec: rank {self.rank} received SIGTERM {self.grace:.0f} s ago and is still inside fit "
            f"(blocked in a collective?); it exits now with status 143 ({GRACE_ENV} sets the grace)",
            file=sys.stderr,
            flush=True,
        )
        if launcher is not None:
            with contextlib.suppress(Exception):
                launcher.kill(signal.SIGKILL)
        os._exit(128 + signal.SIGTERM)


def _mark(connector: Any) -> Any:
    """Lightning's SIGTERM notifier without its broadcast: mark the trainer, forward to launched ranks once."""

    def notify(signum: int, frame: Any) -> None:
        launcher = connector.trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True

    return notify
