"""Every tensor of a batch, whatever its type: for handing side-stream memory to the compute stream.

Lightning moves a custom batch through its own ``.to()``; what comes back can be any
object. :func:`tensors_in` finds its tensors (and KJTs) in containers, dataclasses,
named tuples and plain objects' attributes, so :func:`hand_over` can ``record_stream``
each one on the stream that uses the batch (without it the caching allocator may give
a tensor's memory to the next side-stream copy while the compute stream still reads it)::

    Batch(dense=Tensor, sparse=KJT, meta={"w": Tensor}, extra=[Tensor, "name"])
      -> dense, sparse, meta["w"], extra[0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.sparse import KeyedJaggedTensor

_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.device, torch.dtype)
MAX_DEPTH = 16  # attribute chains deeper than this are not a batch's data


def tensors_in(obj: Any) -> Iterator[Tensor | KeyedJaggedTensor]:
    """Each tensor and KJT reachable from ``obj``, once, depth first.

    Looks into mappings, sequences, sets, dataclasses, and other objects' ``__dict__`` and
    ``__slots__``; not into classes, modules, functions, or tensors and KJTs themselves.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, _ATOMS) or id(item) in seen or depth > MAX_DEPTH:
            continue
        seen.add(id(item))
        if isinstance(item, (Tensor, KeyedJaggedTensor)):
            yield item
            continue
        if isinstance(item, (type, torch.nn.Module)) or callable(item) and not dataclasses.is_dataclass(item):
            continue  # classes, modules and functions carry no batch data
        stack.extend((child, depth + 1) for child in reversed(list(_children(item))))


def _children(item: Any) -> Iterator[Any]:
    if isinstance(item, Mapping):
        yield from item.values()
    elif isinstance(item, (list, tuple, set, frozenset)):
        yield from item
    elif dataclasses.is_dataclass(item):
        yield from (getattr(item, f.name, None) for f in dataclasses.fields(item))
    else:
        yield from getattr(item, "__dict__", {}).values()
        for name in getattr(type(item), "__slots__", ()):
            yield getattr(item, name, None)


def hand_over(batch: Any, stream: torch.cuda.Stream) -> None:
    """The current stream waits for ``stream``'s copies and owns every tensor of ``batch`` from now on."""
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    for t in tensors_in(batch):
        t.record_stream(current)
