"""Two "nodes" on one machine, made with Linux namespaces, to run a job as a cluster runs it.

Each node is ``unshare --uts --mount --pid --mount-proc --fork``: its own hostname
(``node-a``, ``node-b``) resolving to its own loopback address (127.0.0.2, 127.0.0.3, through
an ``/etc/hosts`` bound over the machine's), its own PID namespace and a private tmpfs on
``/dev/shm``; the loopback network and the file system are shared, as on a cluster with a
shared file system. Needs root (or user namespaces) and ``unshare``: :func:`why_not` says
why not, for a ``pytest.skip``.

A node's ranks are started the way a cluster starts them (:func:`start`):

* ``"lightning"``: Lightning's on-prem guide, one process per node with ``MASTER_ADDR``,
  ``MASTER_PORT``, ``NODE_RANK`` and ``WORLD_SIZE``; it starts the node's other ranks;
* ``"torchrun"``: ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N --master-addr ...``;
* ``"slurm"``: every rank started with the variables ``srun`` sets (``SLURM_PROCID``, ...;
  the main address from ``SLURM_NODELIST``).

:meth:`Node.freeze` (SIGSTOP to every process of the node: a host that lost power or
network) and :meth:`Node.kill` (SIGKILL) are the faults.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NAMES = ("node-a", "node-b")
ADDRESSES = ("127.0.0.2", "127.0.0.3")
ROOT = Path(__file__).parents[2]


def why_not() -> str | None:
    """Why two namespace nodes cannot be made here (None when they can)."""
    if not sys.platform.startswith("linux"):
        return "Linux namespaces are Linux's"
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    probe = ["unshare", "--uts", "--mount", "--pid", "--mount-proc", "--fork", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if done.returncode != 0:
        return f"namespaces are not permitted here: {done.stderr.strip() or done.returncode}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """One namespace node: ``proc`` is its ``unshare`` process; its output goes to ``log``."""

    index: int
    proc: subprocess.Popen[bytes]
    log: Path

    def pids(self) -> list[int]:
        """Every process of the node (the ``unshare`` process's descendants), read from ``/proc``."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            kids = children.get(pid, [])
            out += kids
            todo += kids
        return out

    def freeze(self) -> None:
        """SIGSTOP every process of the node: it goes silent, its connections stay open."""
        for pid in self.pids():
            send(pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL the node (its PID namespace's first process: the kernel ends the rest)."""
        for pid in self.pids():
            send(pid, signal.SIGKILL)

    def thaw_and_end(self) -> None:
        for pid in self.pids():
            send(pid, signal.SIGKILL)
            send(pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def send(pid: int, sig: signal.Signals) -> None:
    """``os.kill(pid, sig)``; a process already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def start(out: Path, argv: list[str], launcher: str = "lightning", devices: int = 2) -> list[Node]:
    """Start ``python <argv>`` on two namespace nodes of ``devices`` ranks each, as ``launcher`` would."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="nodes-", dir=out))
    hosts = work / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(ADDRESSES, NAMES, strict=True)))
    nodes = []
    for i, name in enumerate(NAMES):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        for key in [k for k in env if k.startswith(("SLURM_", "TORCHELASTIC_", "LOCAL_", "GROUP_"))]:
            del env[key]
        for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            env.pop(key, None)
        python = [sys.executable, *argv]
        if launcher == "lightning":
            env.update(MASTER_ADDR=ADDRESSES[0], MASTER_PORT=str(port), NODE_RANK=str(i), WORLD_SIZE=str(2 * devices))
            command = " ".join(map(_quote, python))
        elif launcher == "torchrun":
            run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(devices)]
            run += ["--node-rank", str(i), "--master-addr", ADDRESSES[0], "--master-port", str(port), *argv]
            command = " ".join(map(_quote, run))
        elif launcher == "slurm":
            env.update(
                SLURM_JOB_ID="4242",
                SLURM_JOB_NAME="shardrec-multinode",
                SLURM_NTASKS=str(2 * devices),
                SLURM_NNODES="2",
                SLURM_NTASKS_PER_NODE=str(devices),
                SLURM_NODEID=str(i),
                SLURM_NODELIST=",".join(NAMES),
                MASTER_PORT=str(port),
            )
            ranks = [
                f"SLURM_PROCID={i * devices + j} SLURM_LOCALID={j} {' '.join(map(_quote, python))} &"
                for j in range(devices)
            ]
            command = " ".join(ranks) + " status=0; for p in $(jobs -p); do wait $p || status=1; done; exit $status"
        else:
            raise ValueError(f"launcher must be one of 'lightning', 'torchrun', 'slurm', got {launcher!r}")
        script = (
            f"hostname {name} && mount -t tmpfs -o size=512m tmpfs /dev/shm && mount --bind {hosts} /etc/hosts && "
            f"cd {ROOT} && {command}"
        )
        log = work / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["unshare", "--uts", "--mount", "--pid", "--mount-proc", "--fork", "bash", "-c", script],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        nodes.append(Node(i, proc, log))
    return nodes


def _quote(arg: str) -> str:
    return shlex.quote(str(arg))
