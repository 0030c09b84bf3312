"""The same user program at 8, 16 and 24 ranks on one machine (gloo, tiny tables): exact against one
process, a killed rank named by every survivor, a checkpoint written at 16 resumed at 12 exactly.

Each run is ``W`` processes of ``_scale_run.py`` launched as torchrun would (no elastic agent);
``benchmarks/scale_harness.py`` runs the same program for the figures in docs/benchmarks.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _scale_run import launch

TIMEOUT = 1500.0


def _final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def _ok(run) -> None:
    bad = [r for r, c in enumerate(run.codes) if c != 0]
    assert not bad, f"ranks {bad} failed; rank {bad[0]}'s output:\n{run.log(bad[0])[-3000:]}" if bad else ""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run of each plan kind, once per module (``None``: the planner's plan)."""
    cache: dict[str | None, dict[str, torch.Tensor]] = {}

    def get(kind: str | None) -> dict[str, torch.Tensor]:
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"one_{kind}")
            run = launch(1, out, *(["--kind", kind] if kind else []), timeout=TIMEOUT)
            _ok(run)
            cache[kind] = _final(out)
        return cache[kind]

    return get


def _exact(world: int, kind: str | None, out: Path, one_process) -> None:
    run = launch(world, out, *(["--kind", kind] if kind else []), timeout=TIMEOUT)
    _ok(run)
    got, want = _final(out), one_process(kind)
    assert sorted(got) == sorted(want)
    for key, value in want.items():  # the same global batches: only the order of additions differs
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{world} ranks, {kind}: {key}")


def test_8_ranks_match_one_process(tmp_path, one_process):
    _exact(8, None, tmp_path, one_process)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
def test_8_ranks_forced_plans_match_one_process(tmp_path, one_process, kind):
    _exact(8, kind, tmp_path, one_process)


@pytest.mark.slow
@pytest.mark.scale
@pytest.mark.parametrize("world", [16, 24])
@pytest.mark.parametrize("kind", [None, "row_wise", "table_wise"])
def test_many_ranks_match_one_process(tmp_path, one_process, world, kind):
    _exact(world, kind, tmp_path, one_process)


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, pytest.param(16, marks=pytest.mark.scale)])
def test_a_killed_rank_is_named_by_every_survivor(tmp_path, world):
    killed = world // 2 + 1
    run = launch(world, tmp_path, "--kill", str(killed), "--step", "3", timeout=TIMEOUT)
    assert run.codes[killed] != 0
    for rank in (r for r in range(world) if r != killed):
        log = run.log(rank)
        assert run.codes[rank] != 0, f"rank {rank} ended cleanly after rank {killed} was killed"
        assert re.search(rf"lightning_shardrec: rank {killed} (died|stopped)", log), f"rank {rank}:\n{log[-3000:]}"


@pytest.mark.slow
@pytest.mark.scale
def test_a_checkpoint_written_at_16_ranks_resumes_at_12_exactly(tmp_path):
    ckpt = tmp_path / "at16.ckpt"
    _ok(launch(16, tmp_path / "16", "--save", str(ckpt), timeout=TIMEOUT))
    _ok(launch(12, tmp_path / "12", "--resume", str(ckpt), timeout=TIMEOUT))  # saved at max_steps: no step runs
    saved, resumed = _final(tmp_path / "16"), _final(tmp_path / "12")
    assert sorted(saved) == sorted(resumed)
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key
