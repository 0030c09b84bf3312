"""The Lightning layer: ``ShardRecStrategy`` and ``ShardRecFabricStrategy``, registered as ``strategy="shardrec"``
with the Trainer and with Fabric on import."""

from lightning_shardrec.lightning.checkpoints.checkpoint_io import ShardRecCheckpointIO, load_from_checkpoint
from lightning_shardrec.lightning.reports.dynamic_monitor import DynamicTableMonitor
from lightning_shardrec.lightning.strategies.fabric import ShardRecFabricStrategy
from lightning_shardrec.lightning.strategies.options import ShardRecOptions
from lightning_shardrec.lightning.strategies.strategy import ShardRecStrategy

__all__ = [
    "DynamicTableMonitor",
    "ShardRecCheckpointIO",
    "ShardRecFabricStrategy",
    "ShardRecOptions",
    "ShardRecStrategy",
    "load_from_checkpoint",
]
