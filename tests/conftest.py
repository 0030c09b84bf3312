"""Shared pytest setup: deterministic seeds, one intra-op thread (2-core CI), a private kernel cache; zip checks."""

import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable, Iterator

import pytest
import torch
from _forked_python import ForkedPython

from lightning_shardrec.kernels.autotune import CACHE_ENV

torch.set_num_threads(1)


def _build_loops() -> None:
    """The package's compiled loops (``setup.py``: dynamic tables', the torch kernel's), built once into a checkout
    that lacks them, as ``pip install -e .`` does: the tests run both them and their tensor-op twins. Under a lock:
    parallel sessions share it."""
    import fcntl
    import sys
    from pathlib import Path

    from lightning_shardrec.kernels import native as kernel_native
    from lightning_shardrec.modules.dynamic import native

    def current() -> bool:  # built from this native.c and native_rows.c (keys in the libraries; no dlopen: it sticks)
        for module in (native, kernel_native):
            path = module.library_path()
            if path is None or module.source_key().encode() not in path.read_bytes():
                return False
        return True

    root = Path(__file__).resolve().parents[1]
    if current() or not (root / "setup.py").is_file() or shutil.which("cc") is None:
        return
    (root / "build").mkdir(exist_ok=True)
    with open(root / "build" / ".loops.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not current():
            cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"]
            subprocess.run(cmd, cwd=root, check=True, capture_output=True)


_build_loops()


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``kernel="auto"``'s timings go to a temporary directory (inherited by spawned ranks), never ~/.cache."""
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("kernel_cache"))


@pytest.fixture(scope="session")
def forked_python() -> Iterator[ForkedPython]:
    """``python SCRIPT`` for the tests that start scripts: forked from one interpreter that imported torch and
    Lightning (``_forked_python.py``), with this session's environment and unbuffered output."""
    server = ForkedPython({**os.environ, "PYTHONUNBUFFERED": "1"})
    yield server
    server.close()


@pytest.fixture(autouse=True, scope="session")
def _clean_exit() -> Iterator[None]:
    """At the session's end, while the interpreter is whole: the rank pools' workers exit cleanly, and every
    health monitor, library thread and process group a test left in this process is stopped, joined and
    destroyed (a daemon thread inside a torch call at interpreter exit aborts pytest:
    lightning/failures/teardown.py)."""
    yield
    from lightning_shardrec.lightning.failures.teardown import shutdown_at_exit
    from lightning_shardrec.testing import close_pools

    close_pools()
    shutdown_at_exit()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def unzip_t() -> Callable[[object], tuple[int, str] | None]:
    """``unzip -t`` on a file: its exit code and output, or None where the binary is missing."""

    def run(path: object) -> tuple[int, str] | None:
        if shutil.which("unzip") is None:
            return None
        done = subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True, check=False)
        return done.returncode, done.stdout

    return run


@pytest.fixture
def valid_zip(unzip_t: Callable[[object], tuple[int, str] | None]) -> Callable[[object], None]:
    """Check that a file is a sound zip archive: zipfile's ``testzip`` and (where it exists) ``unzip -t`` pass it."""

    def check(path: object) -> None:
        with zipfile.ZipFile(str(path)) as archive:
            assert archive.testzip() is None, f"{path}: bad CRC-32 in {archive.testzip()}"
        verdict = unzip_t(path)
        if verdict is None:
            pytest.skip(f"no unzip binary: zipfile's testzip passed {path}, unzip -t was not run")
        assert verdict[0] == 0 and "No errors detected" in verdict[1], verdict[1]

    return check


_FBGEMM_PARTS = ("training", "inference", "cuda")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs_fbgemm(part='training'): the test needs fbgemm_gpu (its training ops, its inference TBE, or its CUDA "
        "kernels); skipped with the reason when that part does not load",
    )


def fbgemm_missing(part: str = "training") -> str | None:
    """Why fbgemm's ``part`` cannot be used here, or None when it loads (the one check behind ``needs_fbgemm``)."""
    from lightning_shardrec import _fbgemm

    if part not in _FBGEMM_PARTS:
        raise ValueError(f"needs_fbgemm: part must be one of {_FBGEMM_PARTS}, got {part!r}")
    if not _fbgemm.fbgemm_available():
        return f"fbgemm_gpu is not installed or does not load with torch {torch.__version__}"
    if part == "inference" and not _fbgemm.fbgemm_inference_available():
        return "fbgemm_gpu's inference TBE does not load"
    if part == "cuda" and not _fbgemm.fbgemm_ops_on("cuda"):
        return "needs CUDA and fbgemm's CUDA kernels"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(name="needs_fbgemm"):
        reason = fbgemm_missing(*mark.args, **mark.kwargs)
        if reason is not None:
            pytest.skip(reason)
