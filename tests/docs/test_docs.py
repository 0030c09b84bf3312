"""The docs cannot rot: every ```python block runs, and the site builds with --strict."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


PAGE_TIMEOUT_S = 300
PAGE_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def page_runner() -> Iterator[subprocess.Popen[str] | None]:
    """``_page_runner.py`` started with a page's environment (Linux: it forks; elsewhere None: plain ``python``)."""
    if not sys.platform.startswith("linux"):
        yield None
        return
    runner = Path(__file__).with_name("_page_runner.py")
    proc = subprocess.Popen([sys.executable, str(runner)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=PAGE_ENV, cwd=ROOT)  # fmt: skip
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def run_page(runner: subprocess.Popen[str] | None, script: Path) -> tuple[int, str, str]:
    """``python script`` in its directory with :data:`PAGE_ENV`: exit code, stdout, stderr (killed past the timeout)."""
    if runner is None:
        done = subprocess.run([sys.executable, str(script)], cwd=script.parent, capture_output=True, text=True,
                              timeout=PAGE_TIMEOUT_S, env=PAGE_ENV)  # fmt: skip
        return done.returncode, done.stdout, done.stderr
    out, err = script.with_suffix(".out"), script.with_suffix(".err")
    runner.stdin.write(f"{script}\t{out}\t{err}\n")
    runner.stdin.flush()
    pid = int(runner.stdout.readline())
    if not select.select([runner.stdout], [], [], PAGE_TIMEOUT_S)[0]:
        os.kill(pid, signal.SIGKILL)
        runner.stdout.readline()
        return -9, out.read_text(), err.read_text() + f"\n(killed after {PAGE_TIMEOUT_S} s)"
    return int(runner.stdout.readline()), out.read_text(), err.read_text()


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_code_blocks_run(page, tmp_path, page_runner):
    """A page's blocks run in order in one fresh process (later blocks see earlier names), as ``python page.py``
    would run them; on Linux forked from an interpreter that imported torch and Lightning only (``_page_runner``)."""
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(python_blocks(page)))
    code, stdout, stderr = run_page(page_runner, script)
    assert code == 0, f"{page.name}:\n{stdout[-2000:]}\n{stderr[-4000:]}"


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="docs extra not installed (make test installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "KeyedJaggedTensor" in (tmp_path / "site" / "reference" / "index.html").read_text()
