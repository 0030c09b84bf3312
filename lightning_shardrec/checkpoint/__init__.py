"""Checkpoints of sharded models."""

from lightning_shardrec.checkpoint.full_state import gather_full_state, load_full_state

__all__ = ["gather_full_state", "load_full_state"]
