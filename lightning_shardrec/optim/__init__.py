"""Fused (in-backward) embedding optimizers."""

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.optim.fused_optimizer import FusedOptimizer

__all__ = ["EmbOptimType", "FusedOptimConfig", "FusedOptimizer"]
