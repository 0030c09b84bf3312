"""A tensor of a sharded checkpoint that stays on disk until it is used.

:func:`~lightning_shardrec.checkpoint.read_full` with ``lazy=True`` hands out large entries as
:class:`StoredTensor` stand-ins (shape and dtype only). ``dest.copy_(stored)``, what
``Module.load_state_dict`` does with each value, reads the entry straight into ``dest``
with DCP, one saved piece (at most ``PIECE_BYTES``) at a time: loading a whole model costs
the model plus one piece, not the model twice. Any other operation reads the entry into a
tensor of its own once (kept, so later operations and in-place edits see the same values)
and runs on that: correct, only not streamed. Reads run no pickled code.

A stand-in cannot become a parameter itself: ``load_state_dict(..., assign=True)`` raises
(torch's ``Parameter`` refuses a tensor subclass whose ``detach`` gives a plain tensor).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.checkpoint.atomic import describe
from lightning_shardrec.checkpoint.safe_load import load_local
from lightning_shardrec.errors import CheckpointError

_COPY = torch.ops.aten.copy_.default


class StoredTensor(Tensor):
    """Entry ``path`` (DCP's nested key, e.g. ``("state_dict", "ebc.embedding_bags.t0.weight")``) of
    checkpoint directory ``directory``: a CPU tensor of ``size`` and ``dtype`` read when used."""

    _directory: Path
    _path: tuple[str, ...]
    _value: Tensor | None

    @staticmethod
    def __new__(
        cls, directory: str | Path, path: tuple[str, ...], size: torch.Size, dtype: torch.dtype
    ) -> StoredTensor:
        t = compat.make_wrapper_subclass(cls, size, dtype)
        t._directory, t._path, t._value = Path(directory), tuple(path), None
        return t  # type: ignore[no-any-return]

    __torch_function__ = compat.disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"StoredTensor('{self._path[-1]}' in '{self._directory}', shape={tuple(self.shape)}, dtype={self.dtype})"

    def read_into(self, dest: Tensor) -> None:
        """Read the entry into ``dest`` (its shape; any dtype and device), one saved piece at a time."""
        state: dict[str, Any] = {}
        node = state
        for part in self._path[:-1]:
            node = node.setdefault(part, {})
        node[self._path[-1]] = dest
        try:
            with torch.no_grad():
                load_local(state, self._directory)
        except CheckpointException as e:
            raise CheckpointError(
                f"reading '{self._path[-1]}' from checkpoint '{self._directory}' failed:\n  " + "\n  ".join(describe(e))
            ) from None

    def materialize(self) -> Tensor:
        """The entry as a plain CPU tensor, read on first use and kept."""
        if self._value is None:
            value = torch.empty(self.shape, dtype=self.dtype)
            self.read_into(value)
            self._value = value
        return self._value

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        return self.materialize().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved (torch.save, pickle) as the plain tensor it stands for
        return self.materialize().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _COPY and _streams_into(args[0], args[1]):
            args[1].read_into(args[0])
            return args[0]

        def plain(x: Any) -> Any:
            return x.materialize() if isinstance(x, StoredTensor) else x

        return func(*compat.tree_map(plain, args), **compat.tree_map(plain, kwargs))


def _streams_into(dest: Any, source: Any) -> bool:
    """``dest.copy_(source)`` reads ``source`` straight from its file: a plain tensor of the same shape,
    and ``source`` not yet read (once read, its own values are copied, edits included)."""
    return (
        isinstance(source, StoredTensor)
        and source._value is None
        and type(dest) in (Tensor, torch.nn.Parameter)
        and dest.shape == source.shape
        and dest.device.type != "meta"
    )


def stored_weights(directory: str | Path, metadata: Metadata, min_bytes: int) -> dict[str, StoredTensor]:
    """Stand-ins for the weights of DCP checkpoint ``directory`` of at least ``min_bytes``, by DCP key
    (``state_dict.<model key>``)."""
    stored = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(str(p) for p in (metadata.planner_data or {}).get(key, ()))
        if not (isinstance(md, TensorStorageMetadata) and key.startswith("state_dict.") and len(path) == 2):
            continue  # not a weight of the model: the fused state, an object, a nested entry
        if math.prod(md.size) * md.properties.dtype.itemsize >= min_bytes:
            stored[key] = StoredTensor(directory, path, md.size, md.properties.dtype)
    return stored
