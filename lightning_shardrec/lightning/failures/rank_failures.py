"""What the strategy does when a rank fails: name it, stop every rank, say how to resume.

A plain object both strategies hold (:class:`FailureHandling`); it runs the
:class:`~lightning_shardrec.distributed.health.heartbeats.RankMonitor` (heartbeats in the rendezvous
store): a rank that raised reports its error, a killed or hung one is named by the
watchdog or after a failed collective, and every rank exits with that name instead of a
transport error or a 10-minute collective timeout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch.distributed as dist

from lightning_shardrec.distributed.health.heartbeats import RankMonitor, default_store, deferred_to, is_comm_failure
from lightning_shardrec.lightning.failures.data_errors import DATA_ADVICE

_GRACE_S = 10.0  # seconds the main thread's failure report may take before the watchdog exits anyway
_RESUME = "Restart the job and resume with trainer.fit(model, ckpt_path='last')"


#: errors a rank raises for how the program uses the library: a restart would stop at the same point
_PROGRAM_ERRORS = ("PrefetchedBatchEditedError", "RepeatedLookupError")
_FIX_PROGRAM = (
    "This comes from how the program uses the library, not from a lost rank: do what the error says "
    "(resuming from a checkpoint would stop at the same point)"
)


def advice(what: str) -> str:
    """What to do after ``what`` (a rank's failure): a data error's fix, a program error's, else resume from the
    last checkpoint."""
    if "IdOutOfRangeError" in what:
        return DATA_ADVICE
    return _FIX_PROGRAM if any(name in what for name in _PROGRAM_ERRORS) else _RESUME


class FailureHandling:
    """Rank-failure detection and reporting (``heartbeat_timeout``: see the strategy's options).

    A plain object: :meth:`start` once the process group exists (it runs the heartbeat watchdog),
    :meth:`on_exception` when this rank fails, :meth:`stop` at teardown. ``kill`` ends the ranks
    this process launched (Lightning's subprocess launcher) before this one exits.
    """

    def __init__(self, heartbeat_timeout: float | None, kill: Callable[[], None] | None = None) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.kill = kill
        self.monitor: RankMonitor | None = None
        self.failing = False
        self.rank = 0

    def start(self, rank: int, world_size: int, local_world_size: int) -> None:
        """Start the watchdog where the group has a store and several ranks (once)."""
        self.rank = rank
        store = default_store()
        if self.monitor is None and store is not None and world_size > 1:
            # under torchrun or NCCL their own watchdogs tear the job down: ours only names the lost rank
            deferred = deferred_to(dist.get_backend())
            self.monitor = RankMonitor(
                store,
                rank,
                world_size,
                dead_after=None if deferred else self.heartbeat_timeout,
                on_dead=self.on_dead_rank,
                local_world_size=local_world_size,
            )

    def on_dead_rank(self, rank: int, what: str) -> None:
        """The watchdog found a dead or hung rank while this one may be blocked in a collective: exit."""
        if self.failing:  # the main thread is reporting a failure: exit only if it is still stuck there later
            monitor = self.monitor
            later = threading.Timer(_GRACE_S, self._exit_if_stuck, args=(monitor, rank, what))
            later.daemon = True
            later.start()
            return
        self._exit(rank, what)

    def _exit_if_stuck(self, monitor: RankMonitor | None, rank: int, what: str) -> None:
        """Exit unless the failure report finished (the monitor was stopped at teardown) since the watchdog fired."""
        if monitor is not None and self.monitor is monitor:
            self._exit(rank, what)

    def _exit(self, rank: int, what: str) -> None:
        print(f"lightning_shardrec: rank {rank} {what}. Rank {self.rank} exits. {advice(what)}", flush=True)
        if self.kill is not None:
            self.kill()
        os._exit(1)

    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: the others name it and its error, or (a failed collective) name the lost rank."""
        self.failing = True
        if self.monitor is None:
            return
        if not is_comm_failure(exception):
            self.monitor.report_failure(exception)  # the other ranks name this rank and its error
            return
        lost = self.monitor.explain()
        if lost is not None:
            message = f"lightning_shardrec: {lost}. Rank {self.rank} stops too. {advice(lost)}"
            print(message, flush=True)  # before anything can kill this process
            exception.args = (f"{message}\n{exception.args[0] if exception.args else ''}", *exception.args[1:])

    def stop(self) -> None:
        """Stop the heartbeat thread (teardown, after a failure too)."""
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
