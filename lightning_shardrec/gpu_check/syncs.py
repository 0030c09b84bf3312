"""Counting the host syncs a piece of code would make on a GPU.

Two counters, one result type (:class:`SyncCount`):

- :class:`SyncOps` runs anywhere (CPU included): a dispatch mode that counts the aten
  ops which, on a CUDA tensor, make the host wait for the device (a value read back:
  ``_local_scalar_dense`` behind ``.item()`` / ``bool()`` / ``int()``; an output whose
  size depends on the data: ``nonzero``, ``unique``, ``masked_select``, a boolean index,
  ``repeat_interleave`` without ``output_size``, ``bincount``), plus a function mode for the
  reads that never reach the dispatcher on CPU (``Tensor.tolist``) and for tensors made
  from Python data (``torch.tensor(list)``: a host-to-device copy on CUDA). Run on CPU with
  the device-generic code path, it counts what that path costs on CUDA.
- :func:`cuda_syncs` asks CUDA itself: ``torch.cuda.set_sync_debug_mode("warn")`` warns on
  every synchronizing call, and the warnings are counted.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_shardrec._compat.torch import TorchDispatchMode

_aten = torch.ops.aten
# aten ops whose CUDA kernels wait for the device (a value read back, or an output sized by the data)
ALWAYS_SYNC = {
    _aten._local_scalar_dense.default: "item",
    _aten.nonzero.default: "nonzero",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.unique_dim_consecutive.default: "unique",
    _aten.masked_select.default: "masked_select",
    _aten.bincount.default: "bincount",
    _aten.equal.default: "equal",
}
_SIZED_BY_DATA = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}  # unless output_size given
_BOOL_INDEXED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


@dataclass
class SyncCount:
    """Host syncs seen, by kind (``item``, ``nonzero``, ``bool_index``, ``h2d_copy``, ... or ``cuda``),
    and by ``sites``: the innermost ``file:line`` of this package's code that made each one."""

    kinds: Counter[str] = field(default_factory=Counter)
    sites: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def add(self, kind: str, n: int = 1) -> None:
        self.kinds[kind] += n
        self.sites[_site()] += n


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SELF = os.path.dirname(os.path.abspath(__file__))


_TORCH_OPTIM = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "optim")


def _site() -> str:
    """``path:line`` (relative to the repository) of the innermost caller in this package, outside this folder.

    A read made inside ``torch.optim`` (a dense optimizer's step counters, kept on the host on CUDA
    unless ``capturable``) is named ``torch.optim:`` and the package line that stepped it.
    """
    via = ""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_OPTIM):
            via = "torch.optim:"
        if path.startswith(_PACKAGE) and not path.startswith(_SELF):
            return via + _relative(path, frame.lineno)
    return "elsewhere"


def _relative(path: str, line: int | None) -> str:
    """``path:line``, relative to the repository when the file is in this package."""
    path = os.path.abspath(path)
    where = os.path.relpath(path, os.path.dirname(_PACKAGE)) if path.startswith(_PACKAGE) else path
    return f"{where}:{line}"


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, count: SyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        kind = ALWAYS_SYNC.get(func)
        if kind is not None:
            self.count.add(kind)
        elif func in _BOOL_INDEXED and _bool_index(args):
            self.count.add("bool_index")
        elif func in _SIZED_BY_DATA and kwargs.get("output_size") is None:
            self.count.add("repeat_interleave")
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    """Reads that bypass the dispatcher on CPU, and tensors made from Python data (H2D copies on CUDA)."""

    _READS: dict[Callable[..., Any], str] = {torch.Tensor.tolist: "tolist"}
    _MADE: tuple[Callable[..., Any], ...] = (torch.tensor, torch.as_tensor)

    def __init__(self, count: SyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        kind = self._READS.get(func)
        if kind is not None:
            self.count.add(kind)
        elif func in self._MADE and args and not isinstance(args[0], torch.Tensor) and "device" in kwargs:
            self.count.add("h2d_copy")
        return func(*args, **kwargs)


@contextmanager
def SyncOps() -> Iterator[SyncCount]:  # noqa: N802  (used as a context manager, like a class)
    """Count the ops in the block that sync the host on CUDA (see the module docstring)."""
    count = SyncCount()
    with _FunctionCounter(count), _DispatchCounter(count):
        yield count


@contextmanager
def cuda_syncs() -> Iterator[SyncCount]:
    """Count CUDA's own sync warnings in the block (``torch.cuda.set_sync_debug_mode("warn")``)."""
    count = SyncCount()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in seen:
        if "synchroniz" in str(w.message):  # "called a synchronizing CUDA operation"
            count.kinds["cuda"] += 1
            count.sites[_relative(w.filename, w.lineno)] += 1
