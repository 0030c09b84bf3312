"""The Lightning layer: ``ShardRecStrategy`` and ``ShardRecFabricStrategy``, registered as ``strategy="shardrec"``
with the Trainer and with Fabric on import."""

from lightning_shardrec.lightning.checkpoint_io import ShardRecCheckpointIO, load_from_checkpoint
from lightning_shardrec.lightning.dynamic_monitor import DynamicTableMonitor
from lightning_shardrec.lightning.fabric import ShardRecFabricStrategy
from lightning_shardrec.lightning.options import ShardRecOptions
from lightning_shardrec.lightning.strategy import ShardRecStrategy

__all__ = [
    "DynamicTableMonitor",
    "ShardRecCheckpointIO",
    "ShardRecFabricStrategy",
    "ShardRecOptions",
    "ShardRecStrategy",
    "load_from_checkpoint",
]
