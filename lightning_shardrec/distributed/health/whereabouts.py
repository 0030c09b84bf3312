"""Where a rank's process runs, and whether this process can tell that it is gone.

A rank publishes its :class:`Whereabouts` (PID namespace, pid, start time) to the store.
A peer checks that pid only when both run in the *same* PID namespace: the same kernel
boot (``/proc/sys/kernel/random/boot_id``), the same namespace (the device and inode of
``/proc/self/ns/pid``) and the same hostname. Containers that share a hostname (or a
kernel) but not a PID namespace differ in the namespace inode, so neither declares a
healthy rank dead nor checks an unrelated process with the same number; they rely on the
store heartbeat. The process start time (``/proc/<pid>/stat``, field 22) guards against
a pid that was reused after the rank died.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from functools import cache


@cache
def pid_namespace() -> str | None:
    """This process's PID namespace, equal only for processes that see each other's pids.

    ``"<boot id>/<dev>:<inode>/<hostname>"`` on Linux, the hostname on other systems
    (which have no PID namespaces), None when /proc cannot tell (no pid check then).
    """
    host = socket.gethostname()
    if not sys.platform.startswith("linux"):
        return host
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{ns.st_dev}:{ns.st_ino}/{host}"


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22; fields 1-2 end at ")"
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Whereabouts:
    """A rank's process: its PID namespace (:func:`pid_namespace`), pid and start time."""

    namespace: str | None
    pid: int
    started: int | None

    @classmethod
    def of(cls, pid: int | None = None) -> Whereabouts:
        """The whereabouts of ``pid`` (default: this process), in this process's namespace."""
        pid = os.getpid() if pid is None else pid
        return cls(pid_namespace(), pid, start_time(pid))

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> Whereabouts | None:
        """The published record, None for one this version cannot read (then: heartbeat only)."""
        try:
            fields = json.loads(text)
            return cls(fields["namespace"], int(fields["pid"]), fields["started"])
        except (ValueError, KeyError, TypeError):
            return None

    @property
    def host(self) -> str | None:
        """The hostname the rank ran on (None where /proc could not tell its namespace)."""
        return None if self.namespace is None else self.namespace.rsplit("/", 1)[-1]

    def visible(self) -> bool:
        """Whether this process can see that pid: the same, known, PID namespace."""
        return self.namespace is not None and self.namespace == pid_namespace()

    def alive(self) -> bool:
        """Whether the process still runs (call only when :meth:`visible`).

        Gone: no such pid, a zombie (killed, not yet reaped), or another process that
        reused the pid (a different start time).
        """
        foreign = False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            foreign = True  # another user's process: /proc may still tell its state and start time
        if not os.path.isdir("/proc/self"):
            return True  # no /proc: kill(0) is all there is
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return foreign  # exited between the two calls, or hidden (/proc mounted with hidepid)
        except OSError:
            return True
        if fields[0] == "Z":
            return False
        return self.started is None or fields[19] == str(self.started)
