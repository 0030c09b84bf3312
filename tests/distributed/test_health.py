"""RankMonitor: which rank went away, from heartbeats in a store (one process, a HashStore)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lightning_shardrec.distributed.health import RankMonitor, is_comm_failure
from lightning_shardrec.distributed.whereabouts import Whereabouts

PREFIX = "shardrec/health"


def beat_forever(store: dist.Store, rank: int, stop: threading.Event) -> None:
    n = 0
    while not stop.wait(0.05):
        n += 1
        store.set(f"{PREFIX}/beat/{rank}", str(n))


@pytest.fixture
def others():
    """Ranks 1..2 of a 3-rank job: rank 1 keeps beating, rank 2 beat once and stopped."""
    store = dist.HashStore()
    stop = threading.Event()
    store.set(f"{PREFIX}/beat/2", "1")
    thread = threading.Thread(target=beat_forever, args=(store, 1, stop), daemon=True)
    thread.start()
    yield store
    stop.set()
    thread.join()


def test_explain_names_the_rank_whose_heartbeat_stopped(others):
    monitor = RankMonitor(others, 0, 3, interval=0.1, dead_after=None)
    try:
        assert monitor.explain(wait=0.5) == "rank 2 stopped (no heartbeat for 0.5 s: killed or hung)"
    finally:
        monitor.stop()


def test_explain_prefers_a_rank_that_reported_its_exception(others):
    monitor = RankMonitor(others, 0, 3, interval=0.1, dead_after=None)
    RankMonitor(others, 2, 3, interval=0.1, dead_after=None).report_failure(ValueError("id 7 out of range"))
    try:
        assert monitor.explain(wait=0.5) == "rank 2 failed with ValueError: id 7 out of range"
    finally:
        monitor.stop()


def test_finished_ranks_are_not_dead(others):
    others.set(f"{PREFIX}/beat/2", "done")
    monitor = RankMonitor(others, 0, 3, interval=0.1, dead_after=None)
    try:
        assert monitor.explain(wait=0.5) is None
    finally:
        monitor.stop()


def test_watchdog_declares_a_silent_neighbour_once():
    store = dist.HashStore()
    calls: list[tuple[int, str]] = []
    started = time.monotonic()
    survivor = RankMonitor(store, 0, 3, interval=0.05, dead_after=None)
    monitor = RankMonitor(store, 1, 3, interval=0.05, dead_after=0.3, on_dead=lambda r, why: calls.append((r, why)))
    try:
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r for r, _ in calls] == [2]  # rank 1 watches rank 2
        assert 0.3 < time.monotonic() - started < 5
        # every survivor's explanation now names the same rank
        assert survivor.explain(wait=0.1).startswith("rank 2 stopped (no heartbeat for")
    finally:
        monitor.stop()
        survivor.stop()


def test_unreachable_store_blames_rank_0():
    class Gone(dist.HashStore):
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    monitor = RankMonitor(dist.HashStore(), 1, 2, interval=0.1, dead_after=None)
    monitor.store = Gone()
    try:
        assert monitor.explain(wait=0.1).startswith("rank 0 is unreachable")
    finally:
        monitor._stop.set()


@pytest.mark.parametrize(
    ("exc", "comm"),
    [
        (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5. GLHF"), True),
        (dist.DistBackendError("NCCL watchdog"), True),
        (RuntimeError("Timed out waiting 600000ms for recv"), True),
        (ValueError("feature 'user': id 9 not in [0, 5)"), False),
        (RuntimeError("shape mismatch"), False),
    ],
)
def test_is_comm_failure(exc, comm):
    assert is_comm_failure(exc) is comm


@pytest.mark.parametrize(("interval", "dead_after"), [(0.0, None), (1.0, 1.0)])
def test_bad_timing_is_refused(interval, dead_after):
    with pytest.raises(ValueError, match="must"):
        RankMonitor(dist.HashStore(), 0, 2, interval=interval, dead_after=dead_after)


# --- the pid check: only for a rank in this PID namespace (whereabouts.py) ----------------------
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PID namespaces and /proc are Linux's")


def killed_process() -> int:
    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    return proc.pid


def publish(store: dist.Store, rank: int, pid: int, *, beside: bool) -> None:
    """Rank ``rank``'s whereabouts: in this PID namespace, or in a container beside this one (same host)."""
    where = Whereabouts.of(os.getpid())
    if beside:
        boot, dev_ino, host = where.namespace.split("/", 2)
        dev, ino = dev_ino.split(":")
        where = dataclasses.replace(where, namespace=f"{boot}/{dev}:{int(ino) + 1}/{host}")
    store.set(f"{PREFIX}/where/{rank}", dataclasses.replace(where, pid=pid, started=None).encode())


@linux
def test_explain_names_a_killed_rank_in_this_namespace_by_its_pid(others):
    publish(others, 1, killed_process(), beside=False)
    monitor = RankMonitor(others, 0, 3, interval=0.1, dead_after=None)
    try:
        started = time.monotonic()
        assert monitor.explain(wait=5) == "rank 1 died (its process is gone: killed or crashed)"
        assert time.monotonic() - started < 1  # at once, not after waiting for heartbeats
    finally:
        monitor.stop()


@linux
def test_a_rank_in_another_pid_namespace_is_judged_by_its_heartbeat_only(others):
    # rank 1 beats in a container beside this one; its pid number means nothing here
    publish(others, 1, killed_process(), beside=True)
    monitor = RankMonitor(others, 0, 3, interval=0.1, dead_after=None)
    try:
        assert monitor.explain(wait=0.5) == "rank 2 stopped (no heartbeat for 0.5 s: killed or hung)"
    finally:
        monitor.stop()


@linux
@pytest.mark.parametrize("beside", [False, True])
def test_watchdog_names_a_killed_neighbour_at_once_only_in_its_namespace(beside):
    store = dist.HashStore()
    stop = threading.Event()
    beats = threading.Thread(target=beat_forever, args=(store, 1, stop), daemon=True)
    beats.start()  # rank 1's heartbeat goes on: healthy, or so it seems from another namespace
    publish(store, 1, killed_process(), beside=beside)
    calls: list[tuple[int, str]] = []
    monitor = RankMonitor(store, 0, 2, interval=0.05, dead_after=60, on_dead=lambda r, why: calls.append((r, why)))
    try:
        started = time.monotonic()
        deadline = started + (1.0 if beside else 5.0)
        while not calls and time.monotonic() < deadline:
            time.sleep(0.02)
        if beside:
            assert calls == []  # a healthy rank in a container beside this one is not declared dead
        else:
            assert calls == [(1, "died (its process is gone: killed or crashed)")]
            assert time.monotonic() - started < 2  # not the 60 s heartbeat timeout
    finally:
        monitor.stop()
        stop.set()
        beats.join()
