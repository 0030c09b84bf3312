"""Checkpoints of sharded models: full (gathered) files and sharded DCP directories.

Saves are atomic (:mod:`.atomic`), loads check the checkpoint against the model
before writing anything (:mod:`.validate`) and run no pickled code (:mod:`.safe_load`).
"""

from lightning_shardrec.checkpoint.atomic import agree_failures, discard, recover_interrupted, save_file
from lightning_shardrec.checkpoint.full_gather import FullGather, gather_full_state, iter_full_state
from lightning_shardrec.checkpoint.full_state import dense_problems, load_full_state
from lightning_shardrec.checkpoint.plain_optimizer import (
    merge_plain_optimizer_states,
    param_layout,
    plain_layout_possible,
    plain_table_states,
    replicated_keys,
    split_plain_optimizer_states,
    table_parameter_keys,
)
from lightning_shardrec.checkpoint.safe_load import load_file, read_metadata
from lightning_shardrec.checkpoint.sharded_state import (
    META_FILE,
    convert_to_full,
    is_sharded_checkpoint,
    load_sharded,
    read_full,
    save_sharded,
    saved_keys,
    sharded_state_dict,
)
from lightning_shardrec.checkpoint.stored_tensor import StoredTensor
from lightning_shardrec.checkpoint.streamed_file import StreamedFile, save_streamed

__all__ = [
    "META_FILE",
    "StoredTensor",
    "FullGather",
    "StreamedFile",
    "agree_failures",
    "convert_to_full",
    "dense_problems",
    "discard",
    "gather_full_state",
    "is_sharded_checkpoint",
    "iter_full_state",
    "load_file",
    "load_full_state",
    "load_sharded",
    "param_layout",
    "read_full",
    "read_metadata",
    "recover_interrupted",
    "replicated_keys",
    "save_file",
    "save_sharded",
    "saved_keys",
    "save_streamed",
    "sharded_state_dict",
    "merge_plain_optimizer_states",
    "plain_layout_possible",
    "plain_table_states",
    "split_plain_optimizer_states",
    "table_parameter_keys",
]
