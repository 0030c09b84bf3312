"""The supported range as declared: pyproject's bounds and extras, the fbgemm pairs, the backend line."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from lightning_shardrec import _fbgemm

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirement(name: str) -> str:
    (req,) = [r for r in PYPROJECT["dependencies"] if re.match(rf"{name}\b", r) and not r.startswith(f"{name}-")]
    return req


def test_torch_has_no_upper_bound_and_lightning_is_bounded() -> None:
    assert _requirement("torch") == "torch>=2.11"
    assert _requirement("lightning") == "lightning>=2.5,<2.7"


def test_each_fbgemm_extra_is_one_pair_of_the_table() -> None:
    extras = {k: v for k, v in PYPROJECT["optional-dependencies"].items() if k.startswith("torch")}
    want = set()
    for minor, fbgemm in _fbgemm.FBGEMM_PAIRS.items():
        major, mnr = minor.split(".")
        torch_req = f"torch>={minor},<{major}.{int(mnr) + 1}"
        for kind, dist in (("cpu", "fbgemm-gpu-cpu"), ("cuda", "fbgemm-gpu")):
            name = f"torch{major}{mnr}-{kind}"
            want.add(name)
            assert extras.get(name) == [torch_req, f"{dist}=={fbgemm}"], name
    assert set(extras) == want


def test_describe_names_the_build_and_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    line = _fbgemm.describe()
    assert f"torch {torch.__version__}" in line
    build = _fbgemm.installed_build()
    if build is None:
        assert line.startswith("no fbgemm-gpu installed") and line.endswith("portable backend")
    elif _fbgemm.fbgemm_available():
        assert line == f"{build} loaded with torch {torch.__version__}: fbgemm kernels"
    else:
        assert line == f"{build} does not load with torch {torch.__version__}: portable backend"
    monkeypatch.setenv("LIGHTNING_SHARDREC_DISABLE_FBGEMM", "1")
    assert _fbgemm.describe().endswith("switched off by LIGHTNING_SHARDREC_DISABLE_FBGEMM: portable backend")


def test_install_hint_names_the_pair_of_this_torch_or_the_known_pairs() -> None:
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    hint = _fbgemm._install_hint()
    if minor in _fbgemm.FBGEMM_PAIRS:
        assert f"=={_fbgemm.FBGEMM_PAIRS[minor]}, the build for torch {minor}" in hint
        assert f"[torch{minor.replace('.', '')}-cpu]" in hint
    else:
        assert f"no fbgemm-gpu build is paired with torch {minor}" in hint
        assert "torch 2.14 <-> 1.9.0" in hint


def test_make_gpu_check_without_torch_says_so_in_one_line(tmp_path: Path) -> None:
    no_torch = tmp_path / "python-without-site"  # the interpreter, isolated from every site-packages
    no_torch.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    no_torch.chmod(no_torch.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "gpu-check", f"PY={tmp_path}/absent", f"PYTHON={no_torch}"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=60,
    )
    assert out.returncode != 0
    want = f"gpu-check: {no_torch} has no torch: run 'make setup' (or install torch >= 2.11) first"
    assert out.stdout.strip() == want
    assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr


def test_every_c_source_ships_with_the_package() -> None:
    """Each loader hashes its C source to refuse a stale build: an installed package must carry every one."""
    root = Path(__file__).resolve().parents[1]
    package = root / "lightning_shardrec"
    shipped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.c"))
    assert sources and sorted(shipped["lightning_shardrec"]) == sources
