"""Fused (in-backward) embedding optimizers, and TorchRec's optimizer API (``torchrec.optim``)."""

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from lightning_shardrec.optim.deferred_updates import DeferredTableUpdates
from lightning_shardrec.optim.fused_optimizer import FusedOptimizer
from lightning_shardrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
from lightning_shardrec.optim.optimizers import in_backward_optimizer_filter
from lightning_shardrec.optim.repeated_lookups import RepeatedLookups
from lightning_shardrec.optim.rowwise_adagrad import RowWiseAdagrad
from lightning_shardrec.optim.scaled_updates import ScaledTableUpdates

__all__ = [
    "CombinedOptimizer",
    "DeferredTableUpdates",
    "EmbOptimType",
    "FusedOptimConfig",
    "FusedOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RepeatedLookups",
    "RowWiseAdagrad",
    "ScaledTableUpdates",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_filter",
]
