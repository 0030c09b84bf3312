"""Which rank died: heartbeats in the process group's store.

A collective that loses a peer fails on the survivors (gloo: "Connection closed by
peer", NCCL: a timeout) without saying which rank went away, and a rank that hangs
(stopped, stuck in a driver call) blocks everyone until the process-group timeout.
``RankMonitor`` runs a daemon thread per rank that

* writes a heartbeat counter to the rendezvous store every ``interval`` seconds, and
* watches one neighbour ((rank + 1) % W): a neighbour
  in this PID namespace whose process is gone, or a counter that has not moved for
  ``dead_after`` seconds, calls ``on_dead(rank, what)`` (``what``: "died (...)").

The store itself lives in rank 0's process. A host that goes silent (powered off, cut off,
frozen) does not close its connections: a ``TCPStore`` read then waits for ever (its timeout
covers waiting for a key, not a silent server) while writes still "succeed" into the socket.
So each heartbeat is a round trip (``add``), and a timer thread declares rank 0's host
unreachable when no heartbeat has come back for ``dead_after`` seconds: every surviving rank
then exits within ``dead_after`` plus a beat, naming that host and its ranks
(``local_world_size`` ranks per host, Lightning's layout). :meth:`RankMonitor.explain` is
bounded the same way.

After a failed collective, :meth:`RankMonitor.explain` names the lost rank within
about a second: a rank that raised says so itself (:meth:`report_failure`), a killed
rank whose pid this process can see (:mod:`.whereabouts`: same host *and* PID namespace,
same start time) is found by its pid, any other by a heartbeat that stopped.
Only ``torch.distributed`` is used; the monitor works with gloo and NCCL alike.

**Store traffic stays flat.** A beat is three store operations (the ``add``, and the
neighbour's counter: ``check``, ``get``). The default interval (:func:`beat_interval`) grows with
the world so that all ranks together send the store at most :data:`STORE_OPS_PER_S` operations a
second (0.25 s up to 8 ranks, 0.5 s at 16, 16 s at 512); each rank sends at most 12 a second
whatever W is. Who failed is one read: a rank that raises appends ``rank|error`` to one key,
a watchdog that declares a rank sets one key (``lost``), and :meth:`RankMonitor.explain` reads
those two before it looks at heartbeats. :attr:`RankMonitor.store_ops` counts what this rank sent.

**Failures are classified by type** (:func:`is_comm_failure`): torch's ``DistError`` family
(``DistBackendError``, ``DistNetworkError``, ``DistStoreError``). gloo's transport still raises a
plain ``RuntimeError`` (torch 2.13: "[.../gloo/transport/tcp/pair.cc] Connection closed by peer"),
as older torch did everywhere: only then is the message read, for a transport's markers.

**Under torchrun or NCCL** (:func:`deferred_to`) the elastic agent tears the job down when a worker
dies and NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, its heartbeat) ends a hung
collective: the strategy then runs the monitor without a watchdog of its own (``dead_after=None``):
it only names the lost rank after a failed collective (docs/reliability.md, "What catches what").
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping

import torch.distributed as dist

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.distributed.comm.collectives import backend_uses_cuda
from lightning_shardrec.distributed.health.whereabouts import Whereabouts

log = logging.getLogger(__name__)

_PREFIX = "shardrec/health"
#: seconds :meth:`RankMonitor.explain` waits past its ``wait`` for the store (a silent store host never answers)
STORE_GRACE_S = 10.0
_DONE = "done"
_GONE = "died (its process is gone: killed or crashed)"
#: the most store operations a second all ranks' heartbeats send together (the default interval keeps to it)
STORE_OPS_PER_S = 96.0
#: the shortest default heartbeat interval, seconds (small worlds)
MIN_INTERVAL_S = 0.25
_OPS_PER_BEAT = 3  # add; the neighbour's check and get
# Markers of a transport that lost a peer, for errors raised untyped (gloo's transport, torch before DistError).
_TRANSPORT_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out waiting",
    "connection refused",
    "/gloo/transport/",
)


def beat_interval(world_size: int, dead_after: float | None = None) -> float:
    """The default heartbeat interval: all ranks together send at most ``STORE_OPS_PER_S`` store operations a second.

    ``max(0.25, W * 3 / 96)`` seconds, and at most a quarter of ``dead_after`` (a rank is declared
    only after several missed beats).
    """
    interval = max(MIN_INTERVAL_S, world_size * _OPS_PER_BEAT / STORE_OPS_PER_S)
    return interval if dead_after is None else min(interval, dead_after / 4)


#: every monitor whose threads may still run (:func:`stop_all` stops them at interpreter exit)
_LIVE: weakref.WeakSet[RankMonitor] = weakref.WeakSet()
#: seconds :meth:`RankMonitor.stop` waits for each thread (a store call in flight, on a loaded machine)
JOIN_S = 30.0


@functools.cache
def _stop_all_at_exit() -> None:
    """Once, when the first monitor starts: stop every monitor at interpreter exit (a daemon thread still in a
    store call while the interpreter tears down aborts the process: ``terminate called without an active
    exception``). The Lightning layer's exit hook does more (process groups), but a program may use the
    monitor without it."""
    atexit.register(stop_all)


def stop_all(timeout: float = JOIN_S) -> list[str]:
    """Stop every live monitor of this process (their threads joined, up to ``timeout`` s each);
    the names of threads still running after that (stuck in a store call that never returns)."""
    stuck: list[str] = []
    for monitor in list(_LIVE):
        stuck += monitor.stop(timeout)
    return stuck


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store call that lost a peer: by type (torch's ``DistError`` family).

    A plain ``RuntimeError`` (gloo's transport, torch before the typed errors) counts only when its
    message names a transport failure.
    """
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    if type(exc) is not RuntimeError:
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _TRANSPORT_MARKERS)


def deferred_to(backend: str, environ: Mapping[str, str] | None = None) -> str | None:
    """What already tears the job down when a rank dies (then the monitor runs without a watchdog), or None.

    torchrun (``TORCHELASTIC_RUN_ID`` set): its elastic agent; a backend that takes CUDA tensors:
    NCCL's watchdog.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun's elastic agent"
    if backend_uses_cuda(backend):
        return "NCCL's watchdog"
    return None


class _CountingStore:
    """The store, with every operation this monitor sends counted (:attr:`RankMonitor.store_ops`)."""

    def __init__(self, store: dist.Store) -> None:
        self.inner, self.ops = store, 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., object]:
        call = getattr(self.inner, name)

        def counted(*args: object, **kwargs: object) -> object:
            with self._lock:
                self.ops += 1
            return call(*args, **kwargs)

        return counted


class RankMonitor:
    """Heartbeats and a neighbour watchdog for one rank (see the module docstring).

    Args:
        store: the rendezvous store every rank shares (``default_store()``).
        rank, world_size: this rank and the number of ranks.
        interval: seconds between heartbeats; None: :func:`beat_interval` (0.25 up to 8 ranks: a killed
            rank is named within ~0.6 s, before Lightning's launcher tears the job down; then growing
            with W so the store sees a fixed total rate).
        dead_after: seconds without a neighbour heartbeat (or without a heartbeat write that reached
            the store) before ``on_dead`` runs; ``None`` only records heartbeats (for :meth:`explain`)
            and never acts on its own.
        on_dead: called once, on a monitor thread, with ``(rank, what happened)``.
        local_world_size: ranks per host (``h*L .. h*L+L-1`` on host ``h``), to name a lost host's ranks.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        interval: float | None = None,
        dead_after: float | None = 60.0,
        on_dead: Callable[[int, str], None] | None = None,
        local_world_size: int = 1,
    ) -> None:
        if interval is None:
            interval = beat_interval(world_size, dead_after)
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {interval}")
        if dead_after is not None and dead_after <= interval:
            raise ValueError(f"dead_after must exceed the heartbeat interval ({interval} s), got {dead_after}")
        if local_world_size <= 0 or world_size % local_world_size:
            raise ValueError(
                f"local_world_size (ranks per host) must be a positive divisor of world_size {world_size}, "
                f"got {local_world_size}"
            )
        self._counted = _CountingStore(store)
        self.store: dist.Store = self._counted  # type: ignore[assignment]
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.interval, self.dead_after, self.on_dead = interval, dead_after, on_dead
        self._stop = threading.Event()
        self._declared = threading.Lock()  # held by the first declaration: on_dead runs once
        self._where: dict[int, Whereabouts] = {}  # published records read so far (hosts, for names)
        self._lookers: list[threading.Thread] = []  # explain()'s store readers (joined by stop())
        self.store.delete_key(f"{_PREFIX}/beat/{rank}")  # a store can outlive a run (several fits, one group)
        if rank == 0:
            self.store.delete_key(f"{_PREFIX}/lost")
            self.store.delete_key(f"{_PREFIX}/failed")
        self.store.set(f"{_PREFIX}/where/{rank}", Whereabouts.of().encode())
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"shardrec-heartbeat-{rank}", daemon=True)
        _LIVE.add(self)
        _stop_all_at_exit()
        self._thread.start()
        self._timer: threading.Thread | None = None
        if dead_after is not None:
            self._timer = threading.Thread(target=self._time_store, name=f"shardrec-store-timer-{rank}", daemon=True)
            self._timer.start()

    @property
    def store_ops(self) -> int:
        """Store operations this monitor has sent (heartbeats, reads, reports)."""
        return self._counted.ops

    # --- the threads ----------------------------------------------------------------------
    def _beat(self) -> None:
        self.store.add(f"{_PREFIX}/beat/{self.rank}", 1)  # a round trip (a set returns before the store has it)
        self._written = time.monotonic()  # the store answered

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        last, since = None, time.monotonic()
        local: Whereabouts | None = None  # its process, if this one can see its pid
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                seen = self._read(f"beat/{neighbour}") if neighbour != self.rank else None
                if neighbour not in self._where or 0 not in self._where:  # published (it may start late)
                    local = self._local(neighbour)
                    self._whereabouts(0)
            except Exception:  # the store did not answer in time: the store timer judges its host
                continue
            now = time.monotonic()
            if local is not None and seen != _DONE and not local.alive():
                self._declare(neighbour, _GONE + self._host_ranks(neighbour))
                return
            if seen != last or seen == _DONE:
                last, since = seen, now
            elif self.dead_after is not None and now - since > self.dead_after:
                silent = f"{now - since:.0f} s"
                what = f"stopped (no heartbeat for {silent}: killed, hung or its host is down)"
                self._declare(neighbour, what + self._host_ranks(neighbour))
                return

    def _time_store(self) -> None:
        """Declare rank 0's host unreachable when no heartbeat came back for ``dead_after`` seconds."""
        assert self.dead_after is not None  # started only then
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._written
            if silent > self.dead_after:
                what = (
                    f"is unreachable{self._host_ranks(0)}; it serves the rendezvous store, and no heartbeat "
                    f"reached it for {silent:.0f} s (its host is down, cut off or frozen, or rank 0 hung)"
                )
                self._declare(0, what, reachable=False)
                return

    def _declare(self, rank: int, what: str, *, reachable: bool = True) -> None:
        if not self._declared.acquire(blocking=False):
            return
        if reachable:  # first declaration wins; every survivor then names the same rank
            with contextlib.suppress(Exception):
                first = self.store.compare_set(f"{_PREFIX}/lost", "", f"{rank}|{what}").decode()
                if first and "|" in first:
                    found, what = first.split("|", 1)
                    rank = int(found)
        log.error("lightning_shardrec: rank %d %s", rank, what)
        if self.on_dead is not None and not self._stop.is_set():
            self.on_dead(rank, what)

    def _whereabouts(self, rank: int) -> Whereabouts | None:
        """``rank``'s published record (read once, then kept), None until it is published."""
        if rank not in self._where:
            text = self._read(f"where/{rank}")
            where = Whereabouts.decode(text) if text is not None else None
            if where is not None:
                self._where[rank] = where
        return self._where.get(rank)

    def _local(self, rank: int) -> Whereabouts | None:
        """``rank``'s process when this one can see its pid (its death is then visible at once)."""
        where = self._whereabouts(rank)
        return where if where is not None and where.visible() else None

    def _host_ranks(self, rank: int) -> str:
        """`` on host 'b' (ranks 2, 3)``: the host of ``rank`` (as it published) and the ranks on it."""
        where = self._where.get(rank)
        host = where.host if where is not None else None
        named = f" on host {host!r}" if host else f" on host {rank // self.local_world_size}"
        if self.local_world_size == 1:
            return named
        first = rank - rank % self.local_world_size
        return f"{named} (ranks {', '.join(str(r) for r in range(first, first + self.local_world_size))})"

    def stop(self, timeout: float = JOIN_S) -> list[str]:
        """Stop beating and mark this rank as finished (a clean exit is not a death); idempotent.

        Joins every thread of the monitor (up to ``timeout`` s each): a daemon thread still inside a
        store call when the interpreter exits aborts the process (``terminate called without an
        active exception``, lightning/failures/teardown.py). Returns the names of threads still running.
        """
        first = not self._stop.is_set()
        self._stop.set()
        threads = [self._thread, *([self._timer] if self._timer is not None else []), *self._lookers]
        for thread in threads:
            thread.join(timeout=max(timeout, 2 * self.interval))
        self._lookers = [t for t in self._lookers if t.is_alive()]
        stuck = [t.name for t in threads if t.is_alive()]
        if not stuck:
            _LIVE.discard(self)
        if first:
            with contextlib.suppress(Exception):
                self.store.set(f"{_PREFIX}/beat/{self.rank}", _DONE)
        return stuck

    # --- after a failure ----------------------------------------------------------------
    def report_failure(self, exc: BaseException) -> None:
        """Tell the other ranks this rank is going down with ``exc`` (not a lost peer)."""
        with contextlib.suppress(Exception):
            text = f"{type(exc).__name__}: {exc}"[:500].replace("\n", " ")
            # one key: one read names them all (Store.append is in torch's C++ API, not in its type stubs)
            self.store.append(f"{_PREFIX}/failed", f"{self.rank}|{text}\n")  # type: ignore[attr-defined]

    def explain(self, wait: float | None = None) -> str | None:
        """Which rank went away, after a failed collective: ``"rank 1 ..."``, or None if all look alive.

        Checks, in order: ranks that reported an exception, a declaration by any
        watchdog, local ranks whose process is gone, then (waiting up to ``wait``
        seconds, default 3 heartbeats) ranks whose heartbeat does not move.
        """
        wait = 3 * self.interval if wait is None else wait
        found: list[str | None] = []

        def look() -> None:
            with contextlib.suppress(Exception):  # the store itself is unreachable: nothing found
                found.append(self._explain(wait))

        looking = threading.Thread(target=look, name=f"shardrec-explain-{self.rank}", daemon=True)
        self._lookers = [t for t in self._lookers if t.is_alive()] + [looking]
        looking.start()
        looking.join(timeout=wait + STORE_GRACE_S)  # a silent store host never answers a read
        if found:
            return found[0]
        where = self._host_ranks(0)
        return f"rank 0 is unreachable{where} (it hosts the rendezvous store: killed, crashed or its host is down)"

    def _explain(self, wait: float) -> str | None:
        others = [r for r in range(self.world_size) if r != self.rank]
        reports = [line.split("|", 1) for line in (self._read("failed") or "").splitlines() if "|" in line]
        raised = [f"rank {r} failed with {msg}" for r, msg in reports if int(r) != self.rank]
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
        hosts = "".join(dict.fromkeys(self._host_ranks(r) for r in stuck if self._whereabouts(r) is not None))
        return (
            ", ".join(f"rank {r}" for r in stuck) + f" stopped (no heartbeat for {wait:.1f} s: killed or hung)" + hosts
        )

    def _read(self, key: str) -> str | None:
        full = f"{_PREFIX}/{key}"
        if not self.store.check([full]):
            return None
        return self.store.get(full).decode()


def default_store() -> dist.Store | None:
    """The default process group's rendezvous store, or None when it cannot be reached."""
    try:
        return compat.default_store()  # a private torch name: without it the monitor is simply off
    except Exception:
        return None
