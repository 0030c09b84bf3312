"""The Lightning layer: ``ShardRecStrategy``, registered as ``strategy="shardrec"`` on import."""

from lightning_shardrec.lightning.checkpoint_io import ShardRecCheckpointIO, load_from_checkpoint
from lightning_shardrec.lightning.dynamic_monitor import DynamicTableMonitor
from lightning_shardrec.lightning.options import ShardRecOptions
from lightning_shardrec.lightning.strategy import ShardRecStrategy

__all__ = ["DynamicTableMonitor", "ShardRecCheckpointIO", "ShardRecOptions", "ShardRecStrategy", "load_from_checkpoint"]
