"""Which rank died: heartbeats in the process group's store.

A collective that loses a peer fails on the survivors (gloo: "Connection closed by
peer", NCCL: a timeout) without saying which rank went away, and a rank that hangs
(stopped, stuck in a driver call) blocks everyone until the process-group timeout.
``RankMonitor`` runs a daemon thread per rank that

* writes a heartbeat counter to the rendezvous store every ``interval`` seconds, and
* watches one neighbour ((rank + 1) % W, so the store sees O(W) traffic): a neighbour
  in this PID namespace whose process is gone, or a counter that has not moved for
  ``dead_after`` seconds, calls ``on_dead(rank, what)`` (``what``: "died (...)").

After a failed collective, :meth:`RankMonitor.explain` names the lost rank within
about a second: a rank that raised says so itself (:meth:`report_failure`), a killed
rank whose pid this process can see (:mod:`.whereabouts`: same host *and* PID namespace,
same start time) is found by its pid, any other by a heartbeat that stopped.
Only ``torch.distributed`` is used; the monitor works with gloo and NCCL alike.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from lightning_shardrec.distributed.whereabouts import Whereabouts

log = logging.getLogger(__name__)

_PREFIX = "shardrec/health"
_DONE = "done"
_GONE = "died (its process is gone: killed or crashed)"
# Messages of collectives that lost a peer (gloo, NCCL, the TCP store).
_COMM_FAILURES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl",
    "gloo",
    "socket",
    "connection refused",
)


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective or store call that lost a peer."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _COMM_FAILURES)


class RankMonitor:
    """Heartbeats and a neighbour watchdog for one rank (see the module docstring).

    Args:
        store: the rendezvous store every rank shares (``default_store()``).
        rank, world_size: this rank and the number of ranks.
        interval: seconds between heartbeats (0.25: a killed rank is named within ~0.6 s, before
            Lightning's launcher tears the job down; 8 store operations per rank and second).
        dead_after: seconds without a neighbour heartbeat before ``on_dead`` runs; ``None``
            only records heartbeats (for :meth:`explain`) and never acts on its own.
        on_dead: called once, on the monitor thread, with ``(rank, what happened)``.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        interval: float = 0.25,
        dead_after: float | None = 60.0,
        on_dead: Callable[[int, str], None] | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {interval}")
        if dead_after is not None and dead_after <= interval:
            raise ValueError(f"dead_after must exceed the heartbeat interval ({interval} s), got {dead_after}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.dead_after, self.on_dead = interval, dead_after, on_dead
        self._stop = threading.Event()
        self._beats = 0
        self.store.delete_key(f"{_PREFIX}/failed/{rank}")  # a store can outlive a run (several fits, one group)
        if rank == 0:
            self.store.delete_key(f"{_PREFIX}/lost")
        self.store.set(f"{_PREFIX}/where/{rank}", Whereabouts.of().encode())
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"shardrec-heartbeat-{rank}", daemon=True)
        self._thread.start()

    # --- the thread -----------------------------------------------------------------------
    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{_PREFIX}/beat/{self.rank}", str(self._beats))

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        last, since = None, time.monotonic()
        local: Whereabouts | None = None  # its process, if this one can see its pid
        looked = neighbour == self.rank
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                seen = self._read(f"beat/{neighbour}") if neighbour != self.rank else None
                if not looked and self._read(f"where/{neighbour}") is not None:  # published (it may start late)
                    local, looked = self._local(neighbour), True
            except Exception:  # the store's host (rank 0) is gone
                seen, neighbour, local, looked = None, 0, None, True
            now = time.monotonic()
            if local is not None and seen != _DONE and not local.alive():
                self._declare(neighbour, _GONE)
                return
            if seen != last or seen == _DONE:
                last, since = seen, now
            elif self.dead_after is not None and now - since > self.dead_after:
                silent = f"{now - since:.0f} s"
                self._declare(neighbour, f"stopped (no heartbeat for {silent}: killed, hung or its host is down)")
                return

    def _declare(self, rank: int, what: str) -> None:
        with contextlib.suppress(Exception):  # first declaration wins; every survivor then names the same rank
            self.store.compare_set(f"{_PREFIX}/lost", "", f"{rank}|{what}")
        log.error("lightning_shardrec: rank %d %s", rank, what)
        if self.on_dead is not None and not self._stop.is_set():
            self.on_dead(rank, what)

    def _local(self, rank: int) -> Whereabouts | None:
        """``rank``'s process when this one can see its pid (its death is then visible at once)."""
        text = self._read(f"where/{rank}")
        where = Whereabouts.decode(text) if text is not None else None
        return where if where is not None and where.visible() else None

    def stop(self) -> None:
        """Stop beating and mark this rank as finished (a clean exit is not a death)."""
        self._stop.set()
        # Wait out a store call in flight, even on a loaded machine: a thread still inside the store
        # when the interpreter exits can abort the process (lightning/teardown.py).
        self._thread.join(timeout=max(30.0, 2 * self.interval))
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/beat/{self.rank}", _DONE)

    # --- after a failure ----------------------------------------------------------------
    def report_failure(self, exc: BaseException) -> None:
        """Tell the other ranks this rank is going down with ``exc`` (not a lost peer)."""
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/failed/{self.rank}", f"{type(exc).__name__}: {exc}"[:500])

    def explain(self, wait: float | None = None) -> str | None:
        """Which rank went away, after a failed collective: ``"rank 1 ..."``, or None if all look alive.

        Checks, in order: ranks that reported an exception, a declaration by any
        watchdog, local ranks whose process is gone, then (waiting up to ``wait``
        seconds, default 3 heartbeats) ranks whose heartbeat does not move.
        """
        try:
            return self._explain(3 * self.interval if wait is None else wait)
        except Exception:  # the store itself is unreachable: it lives in rank 0's process
            return "rank 0 is unreachable (it hosts the rendezvous store: killed, crashed or its host is down)"

    def _explain(self, wait: float) -> str | None:
        others = [r for r in range(self.world_size) if r != self.rank]
        failed = {r: self._read(f"failed/{r}") for r in others}
        raised = [f"rank {r} failed with {msg}" for r, msg in failed.items() if msg]
        if raised:
            return "; ".join(raised)
        lost = self._read("lost")
        if lost:
            rank, what = lost.split("|", 1)
            return f"rank {rank} {what}"
        gone = [r for r in others if (where := self._local(r)) is not None and not where.alive()]
        if gone:
            return ", ".join(f"rank {r}" for r in gone) + f" {_GONE}"
        first = {r: self._read(f"beat/{r}") for r in others}
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            moved = {r for r in first if self._read(f"beat/{r}") != first[r] or first[r] == _DONE}
            if len(moved) == len(first):
                return None
        stuck = [r for r in first if self._read(f"beat/{r}") == first[r] and first[r] != _DONE]
        if not stuck:
            return None
        return ", ".join(f"rank {r}" for r in stuck) + f" stopped (no heartbeat for {wait:.1f} s: killed or hung)"

    def _read(self, key: str) -> str | None:
        full = f"{_PREFIX}/{key}"
        if not self.store.check([full]):
            return None
        return self.store.get(full).decode()


def default_store() -> dist.Store | None:
    """The default process group's rendezvous store, or None when it cannot be reached."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it the monitor is simply off
        return None
