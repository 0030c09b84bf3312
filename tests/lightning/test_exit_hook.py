"""The exit hook (lightning/failures/teardown.py): nothing the library started outlives the interpreter.

A daemon thread inside a torch store call when the interpreter finalizes ends the process with
``terminate called without an active exception`` (SIGABRT). Health monitors beating every 0.1 ms
are inside one almost all the time; a script that starts them and never stops them must still
exit 0, with every library thread joined before finalization.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch.distributed as dist

from lightning_shardrec.distributed.comm import groups
from lightning_shardrec.distributed.health import heartbeats as health
from lightning_shardrec.lightning.failures import teardown

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading
    import torch.distributed as dist

    def left():  # registered before the library's hook, so it runs after it
        names = [t.name for t in threading.enumerate() if t.name.startswith("shardrec-")]
        print("left at exit:", names, flush=True)

    atexit.register(left)
    from lightning_shardrec.distributed.health.heartbeats import RankMonitor

    store = dist.HashStore()
    monitors = [RankMonitor(store, r, 4, interval=1e-4, dead_after=None) for r in range(4)]
    monitors[0].explain(wait=0.01)
    print("started", len([t for t in threading.enumerate() if t.name.startswith("shardrec-")]), flush=True)
    """
)


def test_a_script_that_leaves_monitors_running_exits_cleanly(tmp_path):
    script = tmp_path / "leave_monitors.py"
    script.write_text(SCRIPT)
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
            check=False,
        )
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]
        assert "started 4" in done.stdout
        assert "left at exit: []" in done.stdout, done.stdout


def test_shutdown_stops_monitors_and_frees_the_cached_groups():
    monitor = health.RankMonitor(dist.HashStore(), 0, 2, interval=0.01, dead_after=None)
    assert any(t.name == "shardrec-heartbeat-0" for t in teardown.library_threads())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cached = groups.cached_group(("test_exit_hook",), lambda: dist.new_group(backend="gloo"))
        assert groups.cached_groups() == [cached]
        teardown.shutdown_at_exit()
        assert teardown.library_threads() == []
        assert monitor not in health._LIVE
        assert groups.cached_groups() == [] and not groups.live_group(cached)
        assert monitor.stop() == []  # idempotent
    finally:
        dist.destroy_process_group()
