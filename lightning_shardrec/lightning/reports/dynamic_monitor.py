"""``DynamicTableMonitor``: log each dynamic table's counters through the Trainer's loggers.

Logged every ``every_n_steps`` optimizer steps (default: the Trainer's
``log_every_n_steps``), one metric per table and figure::

    dynamic/<table>/occupancy   dynamic/<table>/capacity   dynamic/<table>/candidates
    dynamic/<table>/admissions  dynamic/<table>/evictions  dynamic/<table>/expirations
    dynamic/<table>/misses      dynamic/<table>/dropped_candidates
    dynamic/<table>/window_lookups  dynamic/<table>/window_misses  dynamic/<table>/window_ids
    dynamic/<table>/miss_rate   dynamic/<table>/suggested_capacity

The window is the steps since the previous logging step: each gathering starts a new
one. A table whose window ``miss_rate`` exceeds ``miss_rate_warning`` (default 10%)
gets one :class:`~lightning_shardrec.errors.DynamicTableFullWarning` per window (on
rank 0) naming its capacity, occupancy, miss rate and a capacity that would have held
the window's ids.

A callback, like Lightning's ``LearningRateMonitor`` and ``DeviceStatsMonitor``: it
works under a plain ``Trainer`` (add it to ``callbacks``) and under
``strategy="shardrec"``, which adds one when the model has dynamic tables
(``ShardRecStrategy(log_dynamic_stats=False)`` turns that off). For sharded tables the
figures are the sums over ranks (:func:`~lightning_shardrec.distributed.sharded.dynamic_stats.dynamic_stats`,
a collective): every rank gathers them at the same ``global_step`` values, which all
ranks share, and rank 0's loggers write them.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_shardrec.distributed.sharded.dynamic_stats import dynamic_stats, full_table_warnings, has_dynamic_tables
from lightning_shardrec.errors import DynamicTableFullWarning


class DynamicTableMonitor(Callback):
    """Log ``<prefix>/<table>/<figure>`` for every dynamic table every ``every_n_steps`` steps.

    Args:
        every_n_steps: how often, in optimizer steps; ``None``: the Trainer's ``log_every_n_steps``.
        prefix: the metrics' first name part.
        miss_rate_warning: warn for a table that missed more than this share of its window's lookups,
            in ``(0, 1]``; ``None``: never.

    ``last`` holds the figures last gathered (``{metric name: value}``), on every rank;
    ``warned`` the warnings of the last window.
    """

    def __init__(
        self, every_n_steps: int | None = None, prefix: str = "dynamic", miss_rate_warning: float | None = 0.1
    ) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(
                f"DynamicTableMonitor: every_n_steps must be an int >= 1 or None (the Trainer's "
                f"log_every_n_steps), got {every_n_steps!r}"
            )
        if miss_rate_warning is not None and (
            isinstance(miss_rate_warning, bool)
            or not isinstance(miss_rate_warning, (int, float))
            or not 0 < miss_rate_warning <= 1
        ):
            raise ValueError(
                f"DynamicTableMonitor: miss_rate_warning must be a share of lookups in (0, 1] or None (never "
                f"warn), got {miss_rate_warning!r}"
            )
        self.every_n_steps, self.prefix, self.miss_rate_warning = every_n_steps, prefix, miss_rate_warning
        self.last: dict[str, float] = {}
        self.warned: list[str] = []
        self._logged_step = -1
        self._window_start: int | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._window_start = trainer.global_step  # the tables' window began when they were built or loaded

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # the same on every rank: the collective below runs at the same steps
        every = self.every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if step == self._logged_step or step % max(every, 1):
            return
        self._logged_step = step
        stats = dynamic_stats(pl_module, new_window=True)
        if not stats:
            return
        steps = None if self._window_start is None else step - self._window_start
        self._window_start = step
        self.last = {f"{self.prefix}/{t}/{k}": float(v) for t, figures in stats.items() for k, v in figures.items()}
        limit = self.miss_rate_warning
        self.warned = [] if limit is None else full_table_warnings(stats, limit, steps)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last, step=step)
            for message in self.warned:
                warnings.warn(message, DynamicTableFullWarning, stacklevel=2)


def add_dynamic_monitor(trainer: L.Trainer, module: L.LightningModule) -> DynamicTableMonitor | None:
    """Give ``trainer`` a :class:`DynamicTableMonitor` when ``module`` has dynamic tables and it has none.

    Call on every rank (each rank's Trainer needs it: gathering the figures is collective).
    """
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    if not has_dynamic_tables(module) or any(isinstance(c, DynamicTableMonitor) for c in callbacks):
        return None
    monitor = DynamicTableMonitor()
    callbacks.append(monitor)
    return monitor
