"""Lightning's accumulation and clipping with fused tables: their updates deferred to the optimizer step.

:func:`deferral_reason` says, at fit start, whether this fit needs it: ``accumulate_grad_batches
> 1``, ``gradient_clip_val`` by norm, an overridden ``configure_gradient_clipping``, or manual
optimization (whose ``clip_gradients`` and own accumulation come between backward and step).
Then the tables' row gradients wait in a :class:`~lightning_shardrec.optim.DeferredTableUpdates`
and :class:`DeferredGlue` does, around each step of the optimizer that trains the tables,
what one process does to their ``.grad``:

* ``16-mixed``: the kept gradients' NaN/inf check joins the scaler's (as
  :class:`~lightning_shardrec.lightning.training.precision.ScalerGlue`), then they are unscaled with the dense ones;
* ``clip_gradients`` by value clamps them; by norm, the total norm is
  ``sqrt(|dense grads|^2 + sum over ranks of |kept rows|^2)`` (each table row is held by one rank,
  a column-wise shard holds its columns: the sum counts every element once; data-parallel tables
  are dense parameters with DDP's gradient), and its coefficient scales dense grads and kept rows;
* after the step: the rule once per table group with the window's gradient, or nothing when the
  scaler skipped the step.

:func:`watch_repeats` starts the same deferral in the middle of a fit that did not need it, at the
first step that looks a table up twice (positives, then negatives): from then on the step's
lookups are summed before the one update, as ``.grad`` sums them in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shardrec.kernels import KernelBackend
from lightning_shardrec.lightning.training.precision import poison_one_grad
from lightning_shardrec.optim import DeferredTableUpdates, RepeatedLookups


def deferral_reason(trainer: Any, module: Any) -> str | None:
    """Why this fit's table updates wait for the optimizer step; None: they run inside backward."""
    if not module.automatic_optimization:
        return "manual optimization: the tables step in optimizer.step(), after any clip_gradients, as in one process"
    reasons = []
    k = trainer.accumulate_grad_batches
    if k > 1:
        reasons.append(f"accumulate_grad_batches={k}: the tables' row gradients of {k} micro-batches are summed")
    algorithm = trainer.gradient_clip_algorithm
    if trainer.gradient_clip_val and (
        algorithm is None or GradClipAlgorithmType(algorithm) is GradClipAlgorithmType.NORM
    ):
        reasons.append(f"gradient_clip_val={trainer.gradient_clip_val} by norm: the norm counts the tables' gradients")
    if type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        reasons.append("configure_gradient_clipping is overridden: it may clip the tables' gradients")
    return "; ".join(reasons) or None


def deferral_line(reason: str) -> str:
    """The fit-start / plan line that says the updates are deferred, why, and what it costs."""
    return (
        f"ShardRecStrategy: table updates are deferred to the optimizer step ({reason}); fused tables run on the "
        "torch kernel and each rank keeps the window's unique rows x dim of gradient until the step"
    )


REPEATED = "a table is looked up more than once per step: its row gradients of the step's lookups are summed"


def watch_repeats(owner: Any, kernels: list[Any], holder: Any, group: Any) -> RepeatedLookups:
    """Count ``kernels``' lookups per step (the strategy calls ``new_step``); at a table's second lookup in a
    step whose updates run in backward, this fit's updates wait for the optimizer step from then on
    (``owner.deferred_glue``, on the torch kernels; ``owner``: the strategy's
    :class:`~lightning_shardrec.lightning.parameters.updates.StepUpdates`), where the step's lookups are summed."""

    def defer() -> None:
        torch_kernels = [k for k in kernels if k.backend is KernelBackend.TORCH]
        owner.deferred_glue = DeferredGlue.attach(owner, torch_kernels, holder, group, None)
        rank_zero_info(deferral_line(REPEATED))

    return RepeatedLookups(kernels, defer)


class DeferredGlue:
    """The optimizer step and ``clip_gradients`` of a fit whose table updates are deferred (module docstring).

    ``holder``: the optimizer whose param group held the tables (None: none did; then every
    optimizer's step applies them); ``group``: the tables' process group; ``scaler``: the
    ``"16-mixed"`` GradScaler, if any.
    """

    def __init__(
        self,
        updates: DeferredTableUpdates,
        holder: torch.optim.Optimizer | None,
        group: Any,
        device: torch.device,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.updates = updates
        self.holder = holder
        self.group = group
        self.device = device
        self.scaler = scaler

    @classmethod
    def attach(cls, strategy: Any, kernels: Any, holder: Any, group: Any, scaler: Any) -> DeferredGlue:
        """Defer ``kernels``' updates for this fit (``strategy``: anything with ``root_device`` and
        ``precision_plugin``); ``holder``: the (optimizer, group) of the tables."""
        glue = cls(
            DeferredTableUpdates(kernels), None if holder is None else holder[0], group, strategy.root_device, scaler
        )
        glue.install(strategy.precision_plugin)
        return glue

    def _trains_tables(self, optimizer: Any) -> bool:
        return self.holder is None or _unwrapped(optimizer) is self.holder

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    # --- the step ---------------------------------------------------------------------------------
    def optimizer_step(
        self, step: Callable[..., Any], optimizer: Any, closure: Callable[[], Any], model: Any, **kwargs: Any
    ) -> Any:
        if not self._trains_tables(optimizer):
            return step(optimizer, closure, model, **kwargs)
        seen: dict[str, float] = {}

        def closure_then_check() -> Any:
            result = closure()
            if self.scaler is not None and "scale" not in seen:
                seen["scale"] = self.scaler.get_scale()
                found = self.updates.found_inf(self.device)
                if self._distributed():
                    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
                poison_one_grad(optimizer, found)  # the scaler's own check then skips the dense step too
                self.updates.unscale_(seen["scale"])  # with the dense grads (unscale_ follows the closure)
            return result

        out = step(optimizer, closure_then_check, model, **kwargs)
        if "scale" in seen and self.scaler is not None and self.scaler.get_scale() < seen["scale"]:
            self.updates.discard()  # the scale backed off: this step was skipped
        else:
            self.updates.apply()
        return out

    # --- clipping -----------------------------------------------------------------------------------
    def install(self, precision: Any) -> None:
        """Route ``precision.clip_gradients`` through :meth:`clip_gradients` (undo: ``guards.unguard_clipping``)."""
        original = type(precision).clip_gradients.__get__(precision)

        def clip_gradients(
            optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
        ) -> None:
            self.clip_gradients(precision, original, optimizer, clip_val, gradient_clip_algorithm)

        precision.clip_gradients = clip_gradients

    def clip_gradients(
        self, precision: Any, original: Callable[..., None], optimizer: Any, clip_val: float, algorithm: Any
    ) -> None:
        if not clip_val or clip_val <= 0 or not self._trains_tables(optimizer):
            return original(optimizer, clip_val, algorithm)
        if GradClipAlgorithmType(algorithm) is GradClipAlgorithmType.VALUE:
            original(optimizer, clip_val, algorithm)
            self.updates.clamp_(float(clip_val))
            return None
        opt = _unwrapped(optimizer)
        params = [p for p in precision.main_params(opt) if p.grad is not None]
        total = self.updates.sum_squares(self.device)
        if self._distributed():
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        if params:
            dense = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            total = total + dense.to(total.device).square()
        total = total.sqrt()
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)
        # torch's clip_grads_with_norm_ coefficient, for the kept table rows
        self.updates.scale_(torch.clamp(clip_val / (total + 1e-6), max=1.0))
        return None


__all__ = ["DeferredGlue", "deferral_line", "deferral_reason", "watch_repeats"]


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer behind a ``LightningOptimizer`` (its public ``optimizer``), else ``optimizer``."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
