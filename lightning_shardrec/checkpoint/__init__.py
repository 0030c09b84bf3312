"""Checkpoints of sharded models: full (gathered) files and sharded DCP directories."""

from lightning_shardrec.checkpoint.full_state import gather_full_state, load_full_state
from lightning_shardrec.checkpoint.sharded_state import (
    META_FILE,
    convert_to_full,
    load_sharded,
    save_sharded,
    saved_keys,
    sharded_state_dict,
)

__all__ = [
    "META_FILE",
    "convert_to_full",
    "gather_full_state",
    "load_full_state",
    "load_sharded",
    "save_sharded",
    "saved_keys",
    "sharded_state_dict",
]
