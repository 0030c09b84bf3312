"""The docs cannot rot: every ```python block runs, and the site builds with --strict."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _forked_python import ForkedPython

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


PAGE_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def forked() -> Iterator[ForkedPython]:
    """Pages' interpreters: forked from one started with :data:`PAGE_ENV` that imported torch and Lightning."""
    server = ForkedPython(PAGE_ENV)
    yield server
    server.close()


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_code_blocks_run(page, tmp_path, forked):
    """A page's blocks run in order in one fresh process (later blocks see earlier names), as ``python page.py``
    would run them (forked from an interpreter that imported torch and Lightning only: ``tests/_forked_python.py``)."""
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(python_blocks(page)))
    done = forked.run([script], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, f"{page.name}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="docs extra not installed (make test installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "KeyedJaggedTensor" in (tmp_path / "site" / "reference" / "index.html").read_text()
