"""Each rank's sequence of collectives, recorded: a debug option to check their order across ranks.

Every process-group call made through ``torch.distributed``'s functions (by the library, by
Lightning, by user code) while :func:`record_collectives` is active is appended to a
:class:`CollectiveLog`: the operation, the group (its name, the same on every rank for groups
created in the same order), its backend, the tensors' devices and dtypes, the element count
where every rank must send the same (``all_reduce``, ``broadcast``, ...), and the file that
called it. Collectives issued from C++ (DDP's bucket all-reduces, run by its reducer on the
dense group) are not seen.

Collectives on one group must be issued in the same order on every rank (else they pair up
wrongly, or hang); under NCCL, where each group is a communicator with its own stream, calls
on different groups that block must be issued in the same order too, or two ranks can each wait
in a different communicator for the other. :func:`first_difference` compares the ranks'
sequences and names the first call where they part::

    with record_collectives() as log:
        trainer.fit(model, data)
    sequences = gather_from_every_rank(log.keys())   # e.g. returned by run_ranks
    assert first_difference(sequences) is None

Active on one process at a time (it swaps ``torch.distributed``'s function attributes for
recording ones while the ``with`` block runs and puts them back after); meant for tests and
debugging, not for production runs.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: the calls recorded; each with whether every rank passes the same number of elements
OPS: dict[str, bool] = {
    "all_reduce": True,
    "broadcast": True,
    "barrier": True,
    "monitored_barrier": True,
    "reduce": True,
    "all_gather": False,  # a list of per-rank tensors: sizes may differ (uneven batches)
    "all_gather_into_tensor": True,
    "reduce_scatter": False,  # likewise
    "reduce_scatter_tensor": True,
    "all_to_all_single": False,  # splits differ per rank
    "all_to_all": False,
    "gather": False,
    "scatter": False,
    "send": False,
    "recv": False,
    "isend": False,
    "irecv": False,
    "broadcast_object_list": False,  # pickles: sizes differ per rank
    "all_gather_object": False,
    "gather_object": False,
    "scatter_object_list": False,
    "new_group": True,
}
_P2P = frozenset({"send", "recv", "isend", "irecv"})
_HERE = __file__.replace(".pyc", ".py")


@dataclass(frozen=True)
class Call:
    """One recorded call; :meth:`key` is what must be equal on every rank at the same position."""

    op: str
    group: str  # the group's name; for new_group, the new group's
    backend: str
    devices: tuple[str, ...]  # the device types of the tensors passed
    dtypes: tuple[str, ...]
    numel: int | None  # elements passed, where every rank passes the same; else None
    caller: str  # the calling file, from the package root ("lightning_shardrec/lightning/failures/sigterm.py")
    thread: str

    def key(self) -> tuple[object, ...]:
        op = "send/recv" if self.op in _P2P else self.op  # one rank's send is its peer's recv
        return (op, self.group, self.backend, self.dtypes, self.numel)

    def __str__(self) -> str:
        size = "" if self.numel is None else f" {self.numel} elements"
        devices = "/".join(self.devices) or "no tensor"
        return f"{self.op} on group {self.group} ({self.backend}, {devices}{size}) from {self.caller}"


@dataclass
class CollectiveLog:
    """The calls one rank made while :func:`record_collectives` was active, in order."""

    calls: list[Call] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def keys(self) -> list[tuple[object, ...]]:
        return [c.key() for c in self.calls]

    def on_group(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.group == name]

    def from_file(self, *suffixes: str) -> list[Call]:
        """The calls whose caller ends with one of ``suffixes`` (e.g. ``"lightning/failures/sigterm.py"``)."""
        return [c for c in self.calls if c.caller.endswith(suffixes)]


def first_difference(sequences: Sequence[Sequence[Call]]) -> str | None:
    """Where the ranks' sequences first part (rank 0's call against another rank's), or None when equal."""
    if not sequences:
        return None
    base = sequences[0]
    for rank, seq in enumerate(sequences[1:], start=1):
        for i in range(max(len(base), len(seq))):
            mine = base[i] if i < len(base) else None
            theirs = seq[i] if i < len(seq) else None
            if mine is None or theirs is None or mine.key() != theirs.key():
                return (
                    f"collective {i}: rank 0 issued {mine or 'nothing more'}, rank {rank} issued "
                    f"{theirs or 'nothing more'} ({len(base)} against {len(seq)} calls in all)"
                )
    return None


def group_name(group: Any) -> str:
    """``group``'s name (the default group's when None)."""
    pg = dist.group.WORLD if group is None or group is dist.group.WORLD else group
    return str(getattr(pg, "group_name", "?"))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _caller() -> str:
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _HERE and "/torch/" not in name and "contextlib" not in name:
            for root in ("lightning_shardrec/", "lightning/", "tests/", "benchmarks/"):
                if root in name:
                    return root + name.rsplit(root, 1)[1]
            return name
        frame = frame.f_back
    return "?"


def _recording(op: str, original: Callable[..., Any], log: CollectiveLog) -> Callable[..., Any]:
    signature = inspect.signature(original)
    same_size = OPS[op]

    def call(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        group = out if op == "new_group" else bound.get("group")
        tensors = [t for k, v in bound.items() if k != "group" for t in _tensors(v)]
        try:
            backend = str(dist.get_backend(group))
        except (ValueError, RuntimeError):
            backend = "?"
        entry = Call(
            op=op,
            group=group_name(group),
            backend=backend,
            devices=tuple(sorted({t.device.type for t in tensors})),
            dtypes=tuple(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})),
            numel=sum(t.numel() for t in tensors) if same_size else None,
            caller=_caller(),
            thread=threading.current_thread().name,
        )
        with log._lock:
            log.calls.append(entry)
        return out

    return call


_ACTIVE: list[CollectiveLog] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    """Record every ``torch.distributed`` collective this process calls inside the block (see the module docstring)."""
    if _ACTIVE:
        raise RuntimeError("record_collectives: already recording in this process; nest no second recording")
    log = CollectiveLog()
    originals = {op: getattr(dist, op) for op in OPS if hasattr(dist, op)}
    _ACTIVE.append(log)
    try:
        for op, fn in originals.items():
            setattr(dist, op, _recording(op, fn, log))
        yield log
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
        _ACTIVE.clear()
