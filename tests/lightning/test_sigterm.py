"""``LaggedSigterm``: Lightning's per-batch SIGTERM broadcast, made async and read one batch later."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_shardrec.testing import run_ranks


class _Loop:
    def _broadcast_sigterm_tensor(self) -> str:
        return "lightning's own check"


def _batches(rank, world, signal_at, every=1):
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_shardrec.lightning.failures.sigterm import LaggedSigterm

    trainer = SimpleNamespace(received_sigterm=False, fit_loop=SimpleNamespace(epoch_loop=_Loop()))
    loop = trainer.fit_loop.epoch_loop
    check = LaggedSigterm(dist.new_group(backend="gloo"), every=every)
    assert check.install(trainer)
    stopped_at = None
    for i in range(8):
        if rank == 0 and i == signal_at:
            trainer.received_sigterm = True  # only rank 0 got the signal
        try:
            loop._broadcast_sigterm_tensor()
        except SIGTERMException:
            stopped_at = i
            break
    check.remove(wait=stopped_at is None)
    return stopped_at, loop._broadcast_sigterm_tensor()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_stops_one_batch_after_rank_0_got_sigterm(world):
    for rank, (stopped_at, restored) in enumerate(run_ranks(_batches, world, 2)):
        assert stopped_at == 3, f"rank {rank} stopped at batch {stopped_at}, expected 3"
        assert restored == "lightning's own check"


@pytest.mark.parametrize(("signal_at", "expected"), [(0, 1), (1, 5), (4, 5)])
def test_flag_sent_every_4_batches_stops_within_4(signal_at, expected):
    # sent before batches 0, 4, 8, ...; read one batch after it was sent
    for rank, (stopped_at, _) in enumerate(run_ranks(_batches, 2, signal_at, 4)):
        assert stopped_at == expected, f"rank {rank} stopped at batch {stopped_at}, expected {expected}"
        assert stopped_at - signal_at <= 4


def test_every_must_be_positive():

    from lightning_shardrec.lightning.failures.sigterm import LaggedSigterm

    with pytest.raises(ValueError, match="every must be >= 1 batch, got 0"):
        LaggedSigterm(None, every=0)  # type: ignore[arg-type]


def test_no_sigterm_no_stop_and_the_loop_gets_its_check_back():
    for stopped_at, restored in run_ranks(_batches, 2, None):
        assert stopped_at is None
        assert restored == "lightning's own check"


def _install_without_check(rank, world):
    import torch.distributed as dist

    from lightning_shardrec.lightning.failures.sigterm import LaggedSigterm

    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    installed = LaggedSigterm(dist.new_group(backend="gloo")).install(trainer)
    return installed, hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")


def test_install_leaves_a_loop_without_the_check_alone():
    assert run_ranks(_install_without_check, 1) == [(False, False)]
