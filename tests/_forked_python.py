"""``python SCRIPT ARGS`` for tests, each run a fresh process forked from one that has imported torch and Lightning.

Every ``python`` a test starts paid ~3 s for those imports; :class:`ForkedPython` pays them once. The child runs the
script as ``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, ``sys.path[0]`` the script's directory, the
given working directory, empty stdin, stdout and stderr to files, its exit code from ``SystemExit`` or an uncaught
exception). It differs from a fresh interpreter only in that torch and Lightning (third-party modules, nothing of
this project) are imported already. The environment is the one :class:`ForkedPython` was started with.

Run as a script, this file is the server: per JSON line on stdin (``argv``, ``cwd``, ``stdout``, ``stderr``) it
forks a child and writes two lines, the child's pid and then its exit code. Linux only (``os.fork`` with torch
imported); elsewhere :class:`ForkedPython` starts a plain ``python`` per run.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

FORKS = sys.platform.startswith("linux")


class ForkedPython:
    """A server started with ``env``; :meth:`run` is ``subprocess.run([python, *argv], cwd=cwd, env=env, ...)``."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = None
        if FORKS:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, env=env, cwd=Path(__file__).parent)  # fmt: skip

    def run(self, argv: list[object], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """``python *argv`` run in ``cwd``, its output captured; past ``timeout`` seconds it is killed and
        :class:`subprocess.TimeoutExpired` raised, as :func:`subprocess.run` does."""
        args = [sys.executable, *map(str, argv)]
        if self.proc is None:
            return subprocess.run(args, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with tempfile.TemporaryDirectory(prefix="forked-") as logs:
            out, err = Path(logs) / "stdout", Path(logs) / "stderr"
            request = {"argv": args[1:], "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
                self.proc.stdout.readline()
                raise subprocess.TimeoutExpired(args, timeout, output=out.read_text(), stderr=err.read_text())
            code = int(self.proc.stdout.readline())
            return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _become(request: dict[str, object]) -> None:
    """In the forked child: become ``python *argv`` (returns only by raising, as the script ends)."""
    argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, str(request["stdout"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, str(request["stderr"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(str(request["cwd"]))
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _serve() -> None:
    import lightning  # noqa: F401
    import torch  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become(request)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    _serve()
