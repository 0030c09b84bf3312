"""Building and loading the compiled loops of dynamic tables: cache directories and concurrent ranks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_shardrec.modules.dynamic import native, ops
from lightning_shardrec.testing import run_ranks

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler: nothing is built here")


def _no_build(cc: str, source: bytes, out: Path) -> None:
    raise PermissionError(f"read-only: {out}")  # as a build where nothing can be written


IDS = torch.tensor([0, 1, -1, 7, 2**62, -(2**63), 5, 6])


def _serve() -> list[int]:
    """One call of a freshly loaded library (op ``shardrec::serve``)."""
    live = torch.tensor([True, False] * 4)
    return ops.serve(IDS, 2, 4, IDS.clone(), live, 8).tolist()


@pytest.fixture
def fresh_loops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A process whose loops are not built yet, its temporary directory in ``tmp_path / 'tmp'``."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    native.native_loops.cache_clear()
    yield tmp_path
    native.native_loops.cache_clear()


def test_a_read_only_cache_directory_falls_back_to_a_private_temporary_one(
    fresh_loops: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = fresh_loops / "not-a-directory"
    blocked.write_text("")  # XDG_CACHE_HOME/lightning_shardrec cannot be created under a file
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    want = _serve()
    assert native.native_loops() is not None
    built = list((fresh_loops / "tmp").rglob("native-*.so"))
    assert len(built) == 1 and built[0].parent.parent.name == f"lightning_shardrec-{os.getuid()}"
    assert built[0].parent.parent.stat().st_mode & 0o777 == 0o700
    native.native_loops.cache_clear()
    monkeypatch.setattr(native, "_build", _no_build)  # a second process finds it there: nothing built again
    assert _serve() == want


def test_a_library_already_in_a_read_only_cache_is_loaded_without_building(
    fresh_loops: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(fresh_loops / "cache"))
    want = _serve()
    native.native_loops.cache_clear()
    (fresh_loops / "cache" / "lightning_shardrec" / "native").chmod(0o555)
    monkeypatch.setattr(native, "_build", _no_build)
    assert _serve() == want


def test_a_shared_temporary_directory_not_ours_is_refused(fresh_loops: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = fresh_loops / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    shared = fresh_loops / "tmp" / f"lightning_shardrec-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could have put a library there
    with pytest.warns(UserWarning, match=r"building the compiled loops failed \(no usable cache directory .* is not "):
        assert native.native_loops() is None
    assert not list(shared.rglob("*.so"))


def _build_on_rank(rank: int, world_size: int, cache: str) -> tuple[list[int], list[str]]:
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache
    native.native_loops.cache_clear()
    try:
        dist.barrier()  # every rank builds at once
        out = _serve()
        dist.barrier()
        return out, sorted(p.name for p in Path(cache).rglob("*"))
    finally:
        native.native_loops.cache_clear()
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = saved


def test_ranks_that_build_at_once_all_load_one_library(tmp_path: Path) -> None:
    results = run_ranks(_build_on_rank, 2, str(tmp_path))  # the pool most tests share
    outs, files = zip(*results, strict=True)
    assert all(o == _serve() for o in outs)
    lib = [f for f in files[0] if f.endswith(".so")]
    assert len(lib) == 1 and files[0] == ["lightning_shardrec", "native", lib[0]]  # no temporary left behind
