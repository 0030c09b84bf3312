"""The multi-GPU mode of the device check (one process per GPU on NCCL), its code run on CPU ranks with gloo.

With 2+ CUDA devices visible the mode runs on every one; with ``LIGHTNING_SHARDREC_GPU_CHECK_MULTI_CPU=2``
the same code runs on two CPU ranks (gloo, tiny sizes), which is what proves here that it runs.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.gpu_check import Report, Status
from lightning_shardrec.gpu_check import multi as multi_module
from lightning_shardrec.gpu_check.multi import TEST_ENV, MultiMode, check_multi, exact_batches


def test_no_multi_rank_mode_without_two_gpus_or_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TEST_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert MultiMode.detect() is None
    monkeypatch.setenv(TEST_ENV, "2")
    mode = MultiMode.detect()
    assert mode is not None and (mode.world, mode.device_type, mode.backend) == (2, "cpu", "gloo")
    monkeypatch.setenv(TEST_ENV, "1")
    with pytest.raises(ValueError, match=f"{TEST_ENV} must be a number of CPU ranks >= 2, got '1'"):
        MultiMode.detect()


def test_two_gpus_run_on_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    mode = MultiMode.detect()
    assert mode is not None and (mode.world, mode.device_type, mode.backend) == (2, "cuda", "cpu:gloo,cuda:nccl")


def test_the_global_batch_is_the_ranks_slices_in_rank_order() -> None:
    ((whole, parts),) = exact_batches(2, 4, 1)
    for key, jagged in whole.to_dict().items():
        assert torch.equal(jagged.values(), torch.cat([p.to_dict()[key].values() for p in parts]))


def test_the_multi_rank_checks_run_on_two_cpu_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_ENV, "2")
    mode = MultiMode.detect()
    assert mode is not None
    report = Report("cpu", "test", {})
    check_multi(report, mode)
    by_name = {c.name: c for c in report.checks}
    where = "2 ranks (cpu, gloo)"
    assert by_name[f"{where}: torch kernel vs one process"].status is Status.PASS, by_name
    assert all(c.status is not Status.FAIL for c in report.checks), [
        c for c in report.checks if c.status is Status.FAIL
    ]
    assert by_name[f"{where}: host syncs per DLRM step"].figures["per_rank"][0] > 0
    assert all(t > 0 for t in by_name[f"{where}: DLRM step time"].figures["step_s_per_rank"])
    assert all(g > 0 for g in by_name[f"{where}: all-to-all bandwidth"].figures["gbps_per_rank"])


def _shifted_exactness(rank: int, world: int, mode: MultiMode) -> tuple[float, bool]:
    """On a rank: the exactness check against one process trained on other global batches (the next step's)."""
    original = multi_module.exact_batches

    def shifted(world: int, bags: int, steps: int) -> list:
        data = original(world, bags, steps + 1)
        return [(data[i + 1][0], data[i][1]) for i in range(steps)]

    multi_module.exact_batches = shifted  # type: ignore[assignment]
    try:
        return multi_module.exactness(mode, rank, torch.device("cpu"), "torch")
    finally:
        multi_module.exact_batches = original


def test_a_wrong_reference_fails_the_exactness(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: one process trained on other global batches is not the sharded run."""
    from lightning_shardrec.testing import run_ranks

    monkeypatch.setenv(TEST_ENV, "2")
    mode = MultiMode.detect()
    assert mode is not None
    for rank, (worst, ok) in enumerate(run_ranks(_shifted_exactness, 2, mode)):
        assert not ok and worst > 1e-3, f"rank {rank}: max |diff| {worst}"
