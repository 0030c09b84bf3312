"""A small least-recently-used cache for values built per batch shape.

Index plans and gathers depend on the batch sizes of a step; a steady run sees one or
two shapes (the last, short batch of an epoch), but variable batch sizes would make a
plain dict grow by one entry per new shape, forever. This keeps the most recent ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

DEFAULT_SIZE = 8  # shapes kept: a steady run needs 1-2, a cycle of a few batch sizes fits


class BoundedCache(Generic[V]):
    """At most ``size`` values by key; the least recently used goes first."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 1:
            raise ValueError(f"BoundedCache: size must be >= 1, got {size}")
        self.size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key``, made by ``make()`` when absent (then kept, dropping the oldest if full)."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)
