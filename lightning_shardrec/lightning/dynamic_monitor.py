"""``DynamicTableMonitor``: log each dynamic table's counters through the Trainer's loggers.

Logged every ``every_n_steps`` optimizer steps (default: the Trainer's
``log_every_n_steps``), one metric per table and figure::

    dynamic/<table>/occupancy   dynamic/<table>/capacity   dynamic/<table>/candidates
    dynamic/<table>/admissions  dynamic/<table>/evictions  dynamic/<table>/expirations
    dynamic/<table>/misses      dynamic/<table>/dropped_candidates

A callback, like Lightning's ``LearningRateMonitor`` and ``DeviceStatsMonitor``: it
works under a plain ``Trainer`` (add it to ``callbacks``) and under
``strategy="shardrec"``, which adds one when the model has dynamic tables
(``ShardRecStrategy(log_dynamic_stats=False)`` turns that off). For sharded tables the
figures are the sums over ranks (:func:`~lightning_shardrec.distributed.dynamic_stats.dynamic_stats`,
a collective): every rank gathers them at the same ``global_step`` values, which all
ranks share, and rank 0's loggers write them.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_shardrec.distributed.dynamic_stats import dynamic_stats, has_dynamic_tables


class DynamicTableMonitor(Callback):
    """Log ``<prefix>/<table>/<figure>`` for every dynamic table every ``every_n_steps`` steps.

    Args:
        every_n_steps: how often, in optimizer steps; ``None``: the Trainer's ``log_every_n_steps``.
        prefix: the metrics' first name part.

    ``last`` holds the figures last gathered (``{metric name: value}``), on every rank.
    """

    def __init__(self, every_n_steps: int | None = None, prefix: str = "dynamic") -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(
                f"DynamicTableMonitor: every_n_steps must be an int >= 1 or None (the Trainer's "
                f"log_every_n_steps), got {every_n_steps!r}"
            )
        self.every_n_steps, self.prefix = every_n_steps, prefix
        self.last: dict[str, float] = {}
        self._logged_step = -1

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # the same on every rank: the collective below runs at the same steps
        every = self.every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if step == self._logged_step or step % max(every, 1):
            return
        self._logged_step = step
        stats = dynamic_stats(pl_module)
        if not stats:
            return
        self.last = {f"{self.prefix}/{t}/{k}": float(v) for t, figures in stats.items() for k, v in figures.items()}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last, step=step)


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
