"""Whereabouts: a peer's pid is checked only in the same PID namespace, and a reused pid is not it."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_shardrec.distributed.health.whereabouts import Whereabouts, pid_namespace, start_time

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PID namespaces and /proc are Linux's")


def other_namespace() -> str:
    """This host's boot id and hostname with another PID-namespace inode: a container beside this one."""
    ns = pid_namespace()
    assert ns is not None
    boot, dev_ino, host = ns.split("/", 2)
    dev, ino = dev_ino.split(":")
    return f"{boot}/{dev}:{int(ino) + 1}/{host}"


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_round_trip_and_unknown_records():
    here = Whereabouts.of()
    assert here.pid == os.getpid()
    assert Whereabouts.decode(here.encode()) == here
    assert Whereabouts.decode("host:123") is None  # an older version's record: heartbeat only
    assert Whereabouts.decode('{"pid": 1}') is None


@linux
def test_namespace_names_boot_namespace_and_host():
    ns = pid_namespace()
    assert ns is not None
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert ns.startswith(f.read().strip() + "/")
    assert str(os.stat("/proc/self/ns/pid").st_ino) in ns


@linux
def test_only_the_same_namespace_is_visible(sleeper):
    here = Whereabouts.of(sleeper.pid)
    assert here.visible() and here.alive()
    beside = dataclasses.replace(here, namespace=other_namespace())  # same host, own PID namespace
    assert not beside.visible()
    assert not dataclasses.replace(here, namespace=None).visible()


@linux
def test_killed_zombie_and_reaped_processes_are_gone(sleeper):
    where = Whereabouts.of(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5  # the signal is delivered asynchronously
    while where.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    # not reaped yet: a zombie still answers kill(0), yet it is gone
    os.kill(sleeper.pid, 0)
    assert not where.alive()
    sleeper.wait()
    assert not where.alive()


@linux
def test_a_reused_pid_is_not_the_rank(sleeper):
    started = start_time(sleeper.pid)
    assert started is not None
    assert Whereabouts.of(sleeper.pid).alive()
    # the rank died and an unrelated process got its pid: it started at another time
    assert not Whereabouts(pid_namespace(), sleeper.pid, started + 1).alive()
    # no start time published (no /proc at the rank): the pid alone decides
    assert Whereabouts(pid_namespace(), sleeper.pid, None).alive()


@linux
def test_another_users_process_hidden_from_proc_counts_as_alive(sleeper, monkeypatch):
    where = Whereabouts.of(sleeper.pid)
    sleeper.kill()
    sleeper.wait()  # its /proc entry is gone, as another user's is under hidepid=2

    def refuse(pid, sig):
        raise PermissionError(1, "Operation not permitted")  # kill(0) on another user's live process

    monkeypatch.setattr(os, "kill", refuse)
    assert where.alive()
