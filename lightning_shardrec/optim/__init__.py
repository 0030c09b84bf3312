"""Fused (in-backward) embedding optimizers."""

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.optim.deferred_updates import DeferredTableUpdates
from lightning_shardrec.optim.fused_optimizer import FusedOptimizer
from lightning_shardrec.optim.scaled_updates import ScaledTableUpdates

__all__ = ["DeferredTableUpdates", "EmbOptimType", "FusedOptimConfig", "FusedOptimizer", "ScaledTableUpdates"]
