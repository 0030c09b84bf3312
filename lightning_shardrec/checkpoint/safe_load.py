"""Loading checkpoints without running code from them.

``torch.load(weights_only=True)`` covers ``meta.pt`` and full checkpoint files. DCP's
own reader unpickles ``.metadata`` with plain :mod:`pickle` and reads non-tensor
entries with ``torch.load(weights_only=False)``, so a checkpoint from a stranger
could run code. Here the metadata is unpickled by an allow-list of DCP's metadata
classes, and byte entries go through ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lightning_shardrec.errors import CheckpointError

METADATA_FILE = ".metadata"

_DCP = "torch.distributed.checkpoint"
_ALLOWED: dict[str, set[str]] = {
    f"{_DCP}.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes, ``torch.Size`` and dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, set()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"global '{module}.{name}' is not a DCP metadata class; refusing to unpickle it (it could run code)"
        )


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of checkpoint directory ``path``, unpickled by an allow-list."""
    file = Path(path) / METADATA_FILE
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {METADATA_FILE}: it is not a DCP checkpoint or its save did not finish"
        )
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # any unpickling failure: truncated, foreign or malicious
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {METADATA_FILE}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {METADATA_FILE} holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` runs no pickled code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(str(self.path))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        fqn = read_item.dest_index.fqn
        raise CheckpointError(
            f"checkpoint entry '{fqn}' holds objects other than tensors and plain containers; refusing to load it "
            f"(it could run code): {e}"
        ) from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


def set_element(root: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's ``planner_data``: dict keys and list indices) in the nested ``root``,
    making the dicts and lists on the way, as DCP unflattens a state dict."""
    node: Any = root
    for here, after in zip(path[:-1], path[1:], strict=True):
        empty: Any = {} if isinstance(after, str) else []
        if isinstance(node, dict):
            node = node.setdefault(here, empty)
        else:
            node.extend([None] * (int(here) + 1 - len(node)))
            if node[here] is None:
                node[here] = empty
            node = node[here]
    if isinstance(path[-1], int):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def load_local(state: dict[str, Any], path: str | Path) -> None:
    """Read DCP checkpoint directory ``path`` into ``state``'s tensors (allocated by the caller) in this process
    alone (``dcp.load(..., no_dist=True)``), no pickled code run."""
    with warnings.catch_warnings():  # dcp.load says it assumes one process: that is what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)


def load_file(path: str | Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` with a :class:`CheckpointError` naming ``what`` on failure."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {str(path)!r} is missing: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{what} {str(path)!r} holds objects other than tensors and plain containers; refusing to load it "
            f"(it could run code): {e}"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{what} {str(path)!r} is truncated or corrupt: {e}") from None
