"""Fused (in-backward) embedding optimizers, and TorchRec's optimizer API (``torchrec.optim``)."""

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from lightning_shardrec.optim.clipping import GradientClipping, GradientClippingOptimizer
from lightning_shardrec.optim.deferred_updates import DeferredTableUpdates
from lightning_shardrec.optim.fused_optimizer import FusedOptimizer
from lightning_shardrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
from lightning_shardrec.optim.optimizers import in_backward_optimizer_filter
from lightning_shardrec.optim.repeated_lookups import RepeatedLookups
from lightning_shardrec.optim.rowwise_adagrad import RowWiseAdagrad
from lightning_shardrec.optim.scaled_updates import ScaledTableUpdates
from lightning_shardrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

__all__ = [
    "CombinedOptimizer",
    "DeferredTableUpdates",
    "EmbOptimType",
    "FusedOptimConfig",
    "FusedOptimizer",
    "GradientClipping",
    "GradientClippingOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RepeatedLookups",
    "RowWiseAdagrad",
    "ScaledTableUpdates",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_filter",
]
