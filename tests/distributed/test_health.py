"""RankMonitor: which rank went away, from heartbeats in a store (one process, a HashStore)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_shardrec.distributed.health import heartbeats as health
from lightning_shardrec.distributed.health.heartbeats import RankMonitor, is_comm_failure
from lightning_shardrec.distributed.health.whereabouts import Whereabouts

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
            assert calls == [(1, f"died (its process is gone: killed or crashed) on host {socket.gethostname()!r}")]
            assert time.monotonic() - started < 2  # not the 60 s heartbeat timeout
    finally:
        monitor.stop()
        stop.set()
        beats.join()


# --- the store's own host goes silent (rank 0's process serves it) ------------------------------
SERVE = (
    "import sys, time, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def store_host():
    """A TCP store served by another process (rank 0's), and that process to freeze."""
    server = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    yield server, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=10))
    server.kill()
    server.wait()


@linux
def test_a_frozen_store_host_is_declared_within_heartbeat_timeout(store_host):
    server, store = store_host
    elsewhere = dataclasses.replace(Whereabouts.of(server.pid), namespace="boot/1:2/node-a")
    store.set(f"{PREFIX}/where/0", elsewhere.encode())  # rank 0 on host node-a, with rank 1
    stop = threading.Event()
    beats = threading.Thread(target=beat_forever, args=(store, 3, stop), daemon=True)
    beats.start()  # the neighbour (rank 3) is healthy; only the store's host goes silent
    calls: list[tuple[int, str]] = []
    monitor = RankMonitor(
        store, 2, 4, interval=0.1, dead_after=3.0, on_dead=lambda r, why: calls.append((r, why)), local_world_size=2
    )
    try:
        time.sleep(0.5)
        os.kill(server.pid, signal.SIGSTOP)  # a host that lost power: its connections stay open, silent
        frozen = time.monotonic()
        while not calls and time.monotonic() - frozen < 20:
            time.sleep(0.05)
        took = time.monotonic() - frozen
        assert [r for r, _ in calls] == [0], calls
        assert calls[0][1].startswith("is unreachable on host 'node-a' (ranks 0, 1); it serves the rendezvous store")
        assert 3.0 - 0.3 < took < 3.0 + 5  # heartbeat_timeout (from the last beat) plus a few seconds, not for ever
    finally:
        os.kill(server.pid, signal.SIGCONT)
        stop.set()
        monitor.stop()
        beats.join()


@linux
def test_explain_after_the_store_host_froze_names_it_in_bounded_time(store_host, monkeypatch):
    server, store = store_host
    monkeypatch.setattr(health, "STORE_GRACE_S", 1.0)  # the test's own grace (10 s by default)
    monitor = RankMonitor(store, 1, 2, interval=0.1, dead_after=None)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert monitor.explain(wait=0.5).startswith("rank 0 is unreachable on host 0 (it hosts the rendezvous store")
        assert time.monotonic() - started < 0.5 + 1.0 + 2  # a store read would wait for ever
    finally:
        os.kill(server.pid, signal.SIGCONT)
        monitor.stop()


def test_bad_local_world_size_is_refused():
    with pytest.raises(
        ValueError, match=r"local_world_size \(ranks per host\) must be a positive divisor of world_size 4, got 3"
    ):
        RankMonitor(dist.HashStore(), 0, 4, dead_after=None, local_world_size=3)


# --- flat store traffic, one read, typed classification, deferring (#41.2) ----------------------
@pytest.mark.parametrize(("world", "interval"), [(2, 0.25), (8, 0.25), (16, 0.5), (24, 0.75), (512, 16.0)])
def test_default_interval_keeps_the_store_rate_flat(world, interval):
    assert health.beat_interval(world) == interval
    per_rank = 3 / interval  # a beat: add, then the neighbour's check and get
    assert per_rank <= 12 and world * per_rank <= max(health.STORE_OPS_PER_S, 2 * 12)


def test_default_interval_leaves_several_beats_before_dead_after():
    assert health.beat_interval(512, dead_after=8.0) == 2.0
    monitor = RankMonitor(dist.HashStore(), 1, 512, dead_after=None)
    monitor._stop.set()
    assert monitor.interval == 16.0


@pytest.mark.parametrize("world", [3, 64])
def test_one_read_names_every_rank_that_reported(world):
    store = dist.HashStore()
    monitor = RankMonitor(store, 0, world, interval=30.0, dead_after=None)
    try:
        for rank in (1, 2):
            RankMonitor(store, rank, world, interval=30.0, dead_after=None).report_failure(ValueError(f"bad {rank}"))
        before = monitor.store_ops
        assert monitor.explain(wait=0.1) == "rank 1 failed with ValueError: bad 1; rank 2 failed with ValueError: bad 2"
        assert monitor.store_ops - before == 2  # check and get of one key, whatever the world size
    finally:
        monitor._stop.set()


@pytest.mark.parametrize(
    ("exc", "comm"),
    [
        (dist.DistNetworkError("connect() failed"), True),
        (dist.DistStoreError("wait timeout"), True),
        (RuntimeError("NCCL tensor shape mismatch in the user's code"), False),  # text alone no longer counts
        (ValueError("socket timeout setting out of range"), False),
        (TimeoutError("timed out waiting"), False),
    ],
)
def test_failures_are_classified_by_type(exc, comm):
    assert is_comm_failure(exc) is comm


@pytest.mark.parametrize(
    ("backend", "environ", "deferred"),
    [
        ("gloo", {}, None),
        ("nccl", {}, "NCCL's watchdog"),
        ("cpu:gloo,cuda:nccl", {}, "NCCL's watchdog"),
        ("gloo", {"TORCHELASTIC_RUN_ID": "job-7"}, "torchrun's elastic agent"),
    ],
)
def test_torchrun_and_nccl_have_their_own_watchdogs(backend, environ, deferred):
    assert health.deferred_to(backend, environ) == deferred
