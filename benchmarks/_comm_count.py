"""Count what a training step sends: every ``torch.distributed`` collective call, and DDP's all-reduce.

``CommCounter`` wraps the collectives our sharded modules call (``all_to_all_single``,
``all_reduce``, ``reduce_scatter``, ``all_gather``, ...) and, through a DDP comm hook, the dense
gradient all-reduce; each call is tallied by kind and by the group it ran on (``world`` or
``host``), with the bytes this rank sends to ranks of its own host and to other hosts::

    counter = CommCounter(local_world_size=2)
    with counter:
        step()
    counter.tally()   # {"all_to_all_single@world": Tally(calls=4, intra=..., inter=...), ...}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

WRAPPED = (
    "all_to_all_single",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "broadcast",
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Tally:
    """Calls of one kind on one kind of group, and the bytes this rank sent inside / across hosts."""

    calls: int = 0
    intra: int = 0
    inter: int = 0
    seconds: float = 0.0  # inside the call (waiting for the slowest rank included)


class CommCounter:
    """A context manager that tallies this rank's collectives (and DDP's, after :meth:`hook_ddp`)."""

    def __init__(self, local_world_size: int) -> None:
        self.local = local_world_size
        self.on = False
        self._in_ddp = False
        self._tally: dict[str, Tally] = {}
        self._saved: dict[str, Callable[..., Any]] = {}

    def _add(self, kind: str, group: Any, sizes: list[int]) -> Tally:
        """``sizes[i]``: bytes sent to the group's ``i``-th rank (the own rank's share is not sent)."""
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        me = dist.get_rank()
        where = "world" if len(ranks) == dist.get_world_size() else f"group{len(ranks)}"
        if len(ranks) < dist.get_world_size() and len({r // self.local for r in ranks}) == 1:
            where = "host"
        t = self._tally.setdefault(f"{kind}@{where}", Tally())
        t.calls += 1
        for r, n in zip(ranks, sizes, strict=True):
            if r == me:
                continue
            if r // self.local == me // self.local:
                t.intra += n
            else:
                t.inter += n
        return t

    def _sent(self, name: str, args: tuple, kw: dict[str, Any], n: int) -> tuple[str, list[int]]:
        """The kind of collective ``name`` is and the bytes it sends to each of the group's ``n`` ranks."""
        if name == "all_to_all_single":
            inp = args[1]
            splits = args[3] if len(args) > 3 else kw.get("input_split_sizes")
            row = _nbytes(inp) // max(inp.shape[0], 1)
            return "all_to_all", [s * row for s in (splits or [inp.shape[0] // n] * n)]
        if name == "all_reduce":  # a ring: 2 (n-1)/n of it leaves the rank
            return ("ddp_all_reduce" if self._in_ddp else "all_reduce"), [2 * _nbytes(args[0]) // n] * n
        if name == "reduce_scatter":
            return "reduce_scatter", [_nbytes(t) for t in args[1]]
        if name.startswith("reduce_scatter"):
            return "reduce_scatter", [_nbytes(args[1]) // n] * n
        if name == "all_gather":
            return "all_gather", [_nbytes(args[1])] * n
        if name.startswith("all_gather"):
            return "all_gather", [_nbytes(args[1])] * n
        return name, [_nbytes(args[0])] * n

    def __enter__(self) -> CommCounter:
        for name in WRAPPED:
            if hasattr(dist, name):  # reduce_scatter_single / all_gather_single: torch 2.13 and newer
                self._saved[name] = getattr(dist, name)

        def wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kw: Any) -> Any:
                if not self.on:
                    return orig(*args, **kw)
                group = kw.get("group")
                kind, sizes = self._sent(name, args, kw, dist.get_world_size(group))
                tally = self._add(kind, group, sizes)
                t = time.perf_counter()
                try:
                    return orig(*args, **kw)
                finally:
                    tally.seconds += time.perf_counter() - t

            return counted

        for name, fn in self._saved.items():
            setattr(dist, name, wrap(name, fn))
        self.on = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.on = False
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def hook_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Tally DDP's gradient all-reduce (one call per bucket) through a comm hook that then all-reduces."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        group = ddp.process_group

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks the annotation's object
            self._in_ddp = True
            try:
                return allreduce_hook(group, bucket)  # its dist.all_reduce is tallied as ddp_all_reduce
            finally:
                self._in_ddp = False

        ddp.register_comm_hook(None, hook)

    def tally(self) -> dict[str, Tally]:
        return dict(sorted(self._tally.items()))
