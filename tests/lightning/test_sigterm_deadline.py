"""SIGTERM ends a run whose ranks are blocked in collectives within seconds, on both transports
(``SigtermDeadline``), where Lightning's handler alone waits for the collectives' 10-minute timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize(("transport", "pipeline"), [pytest.param("pg", "0", marks=pytest.mark.slow), ("shm", "1")])
def test_sigterm_ends_ranks_blocked_in_collectives(transport, pipeline):
    env = {**os.environ, "PYTHONPATH": ROOT, "LIGHTNING_SHARDREC_SIGTERM_GRACE": "2"}
    proc = subprocess.Popen(
        [sys.executable, "_stuck_fit.py", transport, pipeline],
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what is left of it is checked below
    )
    try:
        for line in proc.stdout:  # rank 1's output comes through the launcher (rank 0's process)
            if "SHARDREC_STUCK" in line:
                break
        time.sleep(1.0)  # both ranks now block in collectives
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as `kill <pid>` does
        _, err = proc.communicate(timeout=90)  # the collectives' own timeout would be 600 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM
    assert (
        "lightning_shardrec: rank 0 received SIGTERM 2 s ago and is still inside fit (blocked in a collective?); "
        "it exits now with status 143 (LIGHTNING_SHARDREC_SIGTERM_GRACE sets the grace)"
    ) in err
    deadline = time.monotonic() + 10
    while _running_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running_in_group(proc.pid) == []  # rank 1 went too


def _running_in_group(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that have not exited (zombies waiting for init to reap them count as gone)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def test_a_bad_grace_is_named(monkeypatch):
    from lightning_shardrec.lightning.failures.sigterm import GRACE_ENV, SigtermDeadline

    monkeypatch.setenv(GRACE_ENV, "soon")
    with pytest.raises(
        ValueError, match="LIGHTNING_SHARDREC_SIGTERM_GRACE must be a number of seconds > 0, got 'soon'"
    ):
        SigtermDeadline(0)
