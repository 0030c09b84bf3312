"""Runs docs pages' scripts, each in a fresh process forked from this one once it has imported torch and Lightning.

    python tests/docs/_page_runner.py      # then, per line on stdin: SCRIPT<TAB>STDOUT FILE<TAB>STDERR FILE

For each line it forks a child that runs ``SCRIPT`` as ``python SCRIPT`` would (``__main__``, ``sys.argv``,
``sys.path[0]`` the script's directory, the current directory the script's, stdin empty, stdout and stderr to the
files), and writes two lines: the child's pid, then its exit code. Started with the environment a page's
interpreter would get, it differs from ``python SCRIPT`` only in that torch and Lightning (third-party modules,
nothing of this project) are imported already: the 3 s each page paid for them is paid once.
"""

from __future__ import annotations

import os
import runpy
import sys


def run(script: str, stdout: str, stderr: str) -> None:
    """In the forked child: become ``python script`` (returns only by raising, as the script ends)."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(os.path.dirname(script))
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main() -> None:
    import lightning  # noqa: F401
    import torch  # noqa: F401

    for line in sys.stdin:
        script, stdout, stderr = line.rstrip("\n").split("\t")
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run(script, stdout, stderr)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
