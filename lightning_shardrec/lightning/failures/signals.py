"""``FitSignals``: SIGTERM during a multi-rank fit, one plain object per strategy.

Two pieces of :mod:`lightning_shardrec.lightning.failures.sigterm`, installed at fit start and removed
at teardown: Lightning's per-batch SIGTERM broadcast made asynchronous
(:class:`~lightning_shardrec.lightning.failures.sigterm.LaggedSigterm`, on the control group) and a
deadline that ends a rank within seconds of SIGTERM, also inside a collective
(:class:`~lightning_shardrec.lightning.failures.sigterm.SigtermDeadline`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_shardrec.lightning.failures.sigterm import LaggedSigterm, SigtermDeadline


class FitSignals:
    """Installs both on a trainer (:meth:`start`), undoes them (:meth:`end`, :meth:`close`)."""

    def __init__(self) -> None:
        self.lagged: LaggedSigterm | None = None
        self.deadline: SigtermDeadline | None = None

    def start(self, trainer: Any, rank: int, world_size: int, group: Callable[[], dist.ProcessGroup]) -> None:
        """Fit start on ``world_size`` > 1 ranks; ``group()``: the control group (gloo, collective the first time)."""
        if world_size <= 1:
            return
        if dist.is_initialized():
            if self.lagged is None:
                self.lagged = LaggedSigterm(group())
            self.lagged.install(trainer)
        if self.deadline is None:  # SIGTERM ends this rank, also inside a collective
            self.deadline = SigtermDeadline(rank)
            self.deadline.install(trainer)

    def end(self) -> None:
        """Fit end: the loop's SIGTERM check back, after the last lagged broadcast."""
        if self.lagged is not None:
            self.lagged.remove()

    def close(self) -> None:
        """Teardown, after a failure too: no deadline, the loop's check back waiting for nobody (the control
        group is the strategy's to close)."""
        if self.deadline is not None:
            self.deadline.remove()
            self.deadline = None
        if self.lagged is not None:
            self.lagged.remove(wait=False)
            self.lagged = None
