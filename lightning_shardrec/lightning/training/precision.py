"""Lightning precision plugins around sharded tables: what each may touch.

* ``"bf16-true"`` / ``"16-true"`` / ``"64-true"`` cast the model (``convert_module``). Only
  the dense part is converted here: sharded tables and their fused optimizer state keep
  the dtype of their table config (fp32 today), and each sharded collection's output is
  cast to the precision's dtype (the default dtype inside Lightning's forward context), so
  the dense layers receive what an unsharded model would give them. The cast is
  differentiable; the tables' gradient arrives in their own dtype.
* ``"16-mixed"`` / ``"bf16-mixed"`` autocast the dense layers. With a ``GradScaler``
  (``"16-mixed"``) the table updates go through :class:`~lightning_shardrec.optim.ScaledTableUpdates`
  (see :class:`ScalerGlue`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.optim import ScaledTableUpdates
from lightning_shardrec.sparse import JaggedTensor, KeyedTensor


@contextmanager
def collections_set_aside(model: nn.Module, sharded: Mapping[str, ShardedCollection]) -> Iterator[None]:
    """While open, ``model`` does not hold its sharded collections (``module.to(dtype)`` skips them)."""
    parents = []
    for path in sharded:
        if not path:  # the model is the collection: nothing dense to convert
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        parents.append((parent, leaf, parent._modules[leaf]))
    for parent, leaf, _ in parents:
        parent._modules[leaf] = None
    try:
        yield
    finally:
        for parent, leaf, module in parents:
            parent._modules[leaf] = module


def convert_dense(
    plugin: Precision, model: nn.Module | None, sharded: Mapping[str, ShardedCollection]
) -> list[RemovableHandle]:
    """``plugin.convert_module`` on everything but the sharded collections; for the plugins that
    cast, hooks that cast the collections' outputs to the forward's default dtype (returned)."""
    if model is None or "" in sharded:  # nothing, or only one collection: nothing dense
        return cast_outputs(sharded.values()) if _casts(plugin) else []
    with collections_set_aside(model, sharded):
        plugin.convert_module(model)
    return cast_outputs(sharded.values()) if _casts(plugin) else []


def _casts(plugin: Precision) -> bool:
    return isinstance(plugin, HalfPrecision | DoublePrecision)


def cast_outputs(collections: Any) -> list[RemovableHandle]:
    """Hooks on each collection: its forward runs with fp32 as the default dtype (the buffers of
    its exchanges must match on every rank, whatever Lightning's forward context set), and its
    pooled values (``KeyedTensor``) or sequence rows (``{feature: JaggedTensor}``) come out in the
    default dtype of the caller."""
    handles = []
    for c in collections:
        if c.__dict__.get("_casts_outputs"):  # a later setup (fit again, validate): hooked already
            continue
        c.__dict__["_casts_outputs"] = True
        handles.append(c.register_forward_pre_hook(_enter_fp32))
        handles.append(c.register_forward_hook(_cast_back, always_call=True))  # a raising forward too
    return handles


def _enter_fp32(module: nn.Module, args: Any) -> None:
    module.__dict__.setdefault("_caller_dtypes", []).append(torch.get_default_dtype())
    torch.set_default_dtype(torch.float32)


def _cast_back(module: nn.Module, args: Any, out: Any) -> Any:
    """The caller's default dtype back (after a forward that raised too: ``out`` is None then); outputs cast."""
    dtype = module.__dict__["_caller_dtypes"].pop()
    torch.set_default_dtype(dtype)
    if isinstance(out, KeyedTensor):
        if out.values().dtype == dtype:
            return out
        return KeyedTensor(out.keys(), out.length_per_key(), out.values().to(dtype), out.key_dim())
    if isinstance(out, dict):
        return {k: _cast_jagged(v, dtype) for k, v in out.items()}
    return out


class ScalerGlue:
    """``"16-mixed"``: the tables' updates follow the ``GradScaler``'s decision for the dense step.

    Around each optimizer step (:meth:`optimizer_step` wraps Lightning's): after the closure
    (forward + scaled backward), the tables' kept gradients are checked for NaN/inf on every
    rank (one ``MAX`` all-reduce of a scalar: ranks hold different shards); if any is
    non-finite, one dense gradient is set to inf, so the scaler's own check finds it: the
    dense step is skipped and the scale backs off. After the scaler's ``update()``, the scale
    went down exactly when the step was skipped: then the table updates are discarded,
    else applied with the gradient divided by the scale of that backward.
    """

    def __init__(self, scaler: torch.amp.GradScaler, updates: ScaledTableUpdates, group: Any, device: torch.device):
        self.scaler = scaler
        self.updates = updates
        self.group = group
        self.device = device

    @staticmethod
    def wanted(plugin: Precision) -> torch.amp.GradScaler | None:
        """The plugin's scaler when it scales the loss (``"16-mixed"``), else None."""
        scaler = getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None
        return scaler if scaler is not None and scaler.is_enabled() else None

    def optimizer_step(
        self, step: Callable[..., Any], optimizer: Any, closure: Callable[[], Any], model: Any, **kwargs: Any
    ) -> Any:
        seen: dict[str, float] = {}

        def closure_then_check() -> Any:
            result = closure()
            if "scale" in seen:  # a second optimizer in the same step: already decided
                return result
            seen["scale"] = self.scaler.get_scale()
            found = self.updates.found_inf(self.device)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
            poison_one_grad(optimizer, found)
            return result

        out = step(optimizer, closure_then_check, model, **kwargs)
        if "scale" in seen:
            if self.scaler.get_scale() < seen["scale"]:  # backed off: this step was skipped
                self.updates.discard()
            else:
                self.updates.apply(seen["scale"])
        return out


def poison_one_grad(optimizer: Any, found: Tensor) -> bool:
    """Set one element of the first dense ``.grad`` of ``optimizer`` to inf where ``found`` > 0
    (a device op: no host sync). False when the optimizer holds no gradient to mark."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not p.grad.is_sparse and p.grad.numel():
                first = p.grad[(0,) * p.grad.dim()] if p.grad.dim() else p.grad
                first.masked_fill_(found.to(first.device) > 0, float("inf"))
                return True
    return False


def _cast_jagged(jt: JaggedTensor, dtype: torch.dtype) -> JaggedTensor:
    if jt.values().dtype == dtype:
        return jt
    return JaggedTensor(jt.values().to(dtype), jt.weights_or_none(), lengths=jt.lengths())


__all__ = ["ScalerGlue", "cast_outputs", "collections_set_aside", "convert_dense"]
