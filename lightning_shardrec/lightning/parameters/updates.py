"""``StepUpdates``: how the tables' fused updates meet the optimizer step, one plain object per strategy.

The fused tables are updated in backward, unless the step needs otherwise: under ``"16-mixed"``
the GradScaler decides whether they count (:class:`~lightning_shardrec.lightning.training.precision.ScalerGlue`);
a clip value clamps the fused rows, norm clipping is refused (:mod:`~lightning_shardrec.lightning.training.guards`);
under gradient accumulation or norm clipping, or once a table is looked up twice in a step,
they wait for the optimizer step (:class:`~lightning_shardrec.lightning.training.deferred.DeferredGlue`);
``check_finite`` checks the loss and the rows (:class:`~lightning_shardrec.kernels.finite.FiniteGuard`).
This object holds those for one fit and routes the step through them; it needs a precision
plugin, the tables' process group and the kernels, not a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shardrec.kernels.finite import FiniteGuard, check_loss
from lightning_shardrec.lightning.parameters.optimizers import Holder, rule_report
from lightning_shardrec.lightning.parameters.tables import ShardedTables
from lightning_shardrec.lightning.training import guards
from lightning_shardrec.lightning.training.deferred import DeferredGlue, deferral_line, watch_repeats
from lightning_shardrec.lightning.training.precision import ScalerGlue
from lightning_shardrec.optim import RepeatedLookups, ScaledTableUpdates


class StepUpdates:
    """The GradScaler glue, the deferred updates, the repeated-lookup watch and the NaN checks of one fit.

    ``root_device`` and ``precision_plugin``: the strategy's (:class:`DeferredGlue` installs on the plugin).
    """

    def __init__(self, root_device: Callable[[], torch.device], precision_plugin: Callable[[], Any]) -> None:
        self._device = root_device
        self._plugin = precision_plugin
        self.scaler_glue: ScalerGlue | None = None  # "16-mixed": table updates follow the GradScaler
        self.deferred_glue: DeferredGlue | None = None  # updates at the optimizer step (lightning/training/deferred.py)
        self.repeats: RepeatedLookups | None = None  # a table looked up twice in a step: summed
        self.finite: FiniteGuard | None = None

    @property
    def root_device(self) -> torch.device:
        return self._device()

    @property
    def precision_plugin(self) -> Any:
        return self._plugin()

    def attach(self, kernels: list[Any], holder: Holder | None, group: Any, deferred: bool, check_finite: bool) -> None:
        """A fit's glue: deferred updates (the scaler's decision included) or the scaler's alone, the watch
        for a table looked up twice, the finite guard."""
        scaler = ScalerGlue.wanted(self.precision_plugin)
        self.deferred_glue = DeferredGlue.attach(self, kernels, holder, group, scaler) if deferred else None
        self.scaler_glue = (
            None
            if scaler is None or deferred
            else ScalerGlue(scaler, ScaledTableUpdates(kernels), group, self.root_device)
        )
        self.repeats = watch_repeats(self, kernels, holder, group)
        if check_finite and self.finite is None:
            self.finite = FiniteGuard(kernels)

    def guard_fit(self, tables: ShardedTables, holder: Holder | None, trainer: Any, deferral: str | None) -> None:
        """At every fit: report (or, strict, refuse) each table's rule; clip fused rows by value or refuse norm
        clipping (``deferral``: the updates wait for the step, where clipping is done,
        lightning/training/deferred.py)."""
        groups = [g for s in tables.sharded.values() for g in s._groups()]
        fused = sorted({t.config.name for g in groups if g.fused for t in g.tables})
        dense = sorted({t.config.name for g in groups if not g.fused for t in g.tables})
        options = tables.options
        explicit, strict = options.sets_fused_rule(), options.strict_optimizer
        assert tables.config is not None
        rank_zero_info(rule_report(holder, tables.config, explicit, fused, dense, strict))
        if fused and deferral is not None:
            rank_zero_info(deferral_line(deferral))
            tables.clip_rows(None)
            return
        clip = guards.fused_clip_value(trainer) if fused else None
        if clip is not None:
            tables.clip_rows(clip)
        if fused:
            guards.guard_clipping(self.precision_plugin, clip)

    def new_step(self) -> None:
        if self.repeats is not None:
            self.repeats.new_step()

    def optimizer_step(self, step: Callable[..., Any], optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        """``step`` (the base strategy's optimizer step) through the glue that is attached."""
        if self.deferred_glue is not None:
            return self.deferred_glue.optimizer_step(step, optimizer, closure, model, **kwargs)
        if self.scaler_glue is not None:
            return self.scaler_glue.optimizer_step(step, optimizer, closure, model, **kwargs)
        out = step(optimizer, closure, model, **kwargs)
        if self.deferred_glue is not None:  # started in this step's closure: a table looked up twice (watch_repeats)
            self.deferred_glue.updates.apply()
        return out

    def check_loss(self, loss: torch.Tensor, step: int) -> None:
        if self.finite is not None:
            check_loss(loss, step)

    def check_rows(self) -> None:
        if self.finite is not None:
            self.finite.check_rows()

    def detach(self) -> None:
        """The fit ended: the guards off; the glue kept (``skipped_steps``) until the next fit replaces it."""
        if self.finite is not None:
            self.finite.remove()
            self.finite = None
        if self.scaler_glue is not None:
            self.scaler_glue.updates.detach()
        if self.deferred_glue is not None:
            self.deferred_glue.updates.detach()
        if self.repeats is not None:
            self.repeats.detach()
            self.repeats = None
        guards.unguard_clipping(self.precision_plugin)
