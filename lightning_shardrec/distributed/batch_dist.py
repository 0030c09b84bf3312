"""The input distribution every sharded collection shares, now or ahead of time.

:func:`distribute_inputs` runs it for the batch at hand. :func:`start_input_dist`
starts it for a *later* batch with ``async_op=True`` collectives and returns a
:class:`PrefetchHandle`; the collection's ``forward`` waits on the handle when it
gets the very KJT object the handle was started for. Both send the same header and
the same all-to-alls, so they produce the same :class:`DistContext`::

    prefetch(kjt_{i+1})      header all-to-all issued (async)
    forward(kjt_i)           ... batch i's compute overlaps it ...
    handle.progress()        header waited on; lengths / ids / weights issued (async)
    backward(batch i)        ... overlaps the id all-to-alls ...
    forward(kjt_{i+1})       waits on them, regroups, skips the input distribution

The async collectives run on their own process group (``env`` here), so they never
interleave with the output distribution's or DDP's collectives on other groups.
Every rank must call ``prefetch``/``progress``/``wait`` in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm import (
    ShardingEnv,
    Waitable,
    exchange_header,
    exchange_header_async,
    on_stream,
)
from lightning_shardrec.distributed.input_dist import PendingExchange, Routed, exchange_async
from lightning_shardrec.distributed.sharding import EmbeddingSharding
from lightning_shardrec.errors import ShardingError
from lightning_shardrec.sparse import KeyedJaggedTensor

Split = Callable[[KeyedJaggedTensor], tuple[KeyedJaggedTensor, list[KeyedJaggedTensor]]]


class BatchTag(Protocol):
    """Ints every rank adds to the header (e.g. its loop position), and the check of all ranks' tags."""

    width: int

    def tag(self, ahead: bool = False, ended: bool = False) -> list[int]:
        """This rank's ints; ``ahead``: for the batch after this one (prefetch), ``ended``: which this rank lacks."""
        ...

    def check(self, tags: list[list[int]], rank: int) -> None: ...


@dataclass
class DistContext:
    """One batch between the stages: the local KJT, every rank's batch size, per-group inputs."""

    local: KeyedJaggedTensor
    batch_sizes: list[int]
    inputs: list[KeyedJaggedTensor]  # per group, the kernel's input
    subs: list[KeyedJaggedTensor] = field(default_factory=list)  # per group, this rank's ids
    routed: list[Routed | None] = field(default_factory=list)  # per group, what this rank sent
    recv_values: list[list[int]] = field(default_factory=list)  # per group, ids from each source


def distribute_inputs(
    features: KeyedJaggedTensor,
    split: Split,
    groups: Sequence[EmbeddingSharding],
    env: ShardingEnv,
    device: torch.device,
    tag: BatchTag | None = None,
) -> DistContext:
    """The input distribution, now.

    ``split`` checks the batch and cuts it into one KJT per group. Every rank then sends
    one small header (its batch size, its id count per group and destination, a
    failure flag) before any bulk collective, so a bad batch on one rank stops every
    rank with an error instead of a hang; ``tag``'s ints ride along and are checked the same
    way. Then each group routes its ids: every group's all-to-alls are issued (async) before
    any is waited for, as :meth:`PrefetchHandle.progress` does.
    """
    kjt, subs, routed, error = _split_and_route(features, split, groups)
    header = _with_tag(_header(kjt, routed, error, env.world_size, len(groups)), tag)
    recv = exchange_header(_to_device(header, device), env).cpu()
    batch_sizes, recv_values = _read_header(recv, error, env, len(groups))
    if tag is not None:
        tag.check(recv[:, 2 + len(groups) :].tolist(), env.rank)
    pending = _issue_exchanges(groups, subs, routed, recv_values, batch_sizes, env)
    return DistContext(kjt, batch_sizes, _finish_exchanges(groups, pending), subs, routed, recv_values)


def _issue_exchanges(
    groups: Sequence[EmbeddingSharding],
    subs: list[KeyedJaggedTensor],
    routed: list[Routed | None],
    recv_values: list[list[int]],
    batch_sizes: list[int],
    env: ShardingEnv,
) -> list[PendingExchange | KeyedJaggedTensor]:
    """Per group: its id all-to-alls issued (async), or its input when nothing crosses the wire."""
    return [
        g.input_dist(s, r, v, batch_sizes) if r is None else exchange_async(r, v, g.received_keys(), batch_sizes, env)
        for g, s, r, v in zip(groups, subs, routed, recv_values, strict=True)
    ]


def _finish_exchanges(
    groups: Sequence[EmbeddingSharding], pending: list[PendingExchange | KeyedJaggedTensor]
) -> list[KeyedJaggedTensor]:
    """Each group's kernel input: waits for the exchanges :func:`_issue_exchanges` started."""
    return [
        g.after_exchange(p.wait()) if isinstance(p, PendingExchange) else p
        for g, p in zip(groups, pending, strict=True)
    ]


def start_input_dist(
    features: KeyedJaggedTensor,
    split: Split,
    groups: Sequence[EmbeddingSharding],
    env: ShardingEnv,
    device: torch.device,
    tag: BatchTag | None = None,
) -> PrefetchHandle:
    """The input distribution, started: local checks and routing now, the header all-to-all issued async.

    A bad batch does not raise here: the failure flag travels in the header and
    :meth:`PrefetchHandle.wait` raises on every rank, as :func:`distribute_inputs` would.
    On CUDA the work is queued on the current stream (the caller's side stream).
    """
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    kjt, subs, routed, error = _split_and_route(features, split, groups)
    header = _with_tag(_header(kjt, routed, error, env.world_size, len(groups)), tag, ahead=True)
    recv, work = exchange_header_async(_to_device(header, device), env)
    return PrefetchHandle(features, groups, env, stream, kjt, subs, routed, error, recv, work, tag)


def start_end_of_data(
    groups: Sequence[EmbeddingSharding], env: ShardingEnv, device: torch.device, tag: BatchTag
) -> EndOfData:
    """Where the other ranks prefetch their next batch and this rank has none: send a header saying so (async)."""
    header = torch.zeros(env.world_size, 2 + len(groups), dtype=torch.long)
    recv, work = exchange_header_async(_to_device(_with_tag(header, tag, ahead=True, ended=True), device), env)
    return EndOfData(recv, work, tag, env, len(groups))


class EndOfData:
    """The header of :func:`start_end_of_data` in flight; :meth:`wait` raises unless every rank's data ended too."""

    def __init__(
        self, header: Tensor, work: Waitable | None, tag: BatchTag, env: ShardingEnv, groups: int
    ) -> None:
        self._header, self._work, self._tag, self._env, self._groups = header, work, tag, env, groups

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        recv = self._header.cpu()
        _read_header(recv, None, self._env, self._groups)
        self._tag.check(recv[:, 2 + self._groups :].tolist(), self._env.rank)


def _to_device(header: Tensor, device: torch.device) -> Tensor:
    """The host-built header on the collective's device; to CUDA from pinned memory without blocking.

    A pageable copy would wait for everything queued on the stream (a second host sync per
    step next to the unavoidable read of the received header).
    """
    if device.type != "cuda":
        return header.to(device)
    return header.pin_memory().to(device, non_blocking=True)


def _with_tag(header: Tensor, tag: BatchTag | None, ahead: bool = False, ended: bool = False) -> Tensor:
    """``header`` with ``tag``'s ints appended to every row (unchanged without a tag)."""
    if tag is None:
        return header
    ints = torch.tensor([tag.tag(ahead=ahead, ended=ended)], dtype=torch.long).expand(header.shape[0], -1)
    return torch.cat([header, ints], 1)


class PrefetchHandle:
    """A batch's input distribution in flight; ``features`` is the KJT object it was started for."""

    def __init__(
        self,
        features: KeyedJaggedTensor,
        groups: Sequence[EmbeddingSharding],
        env: ShardingEnv,
        stream: torch.cuda.Stream | None,
        kjt: KeyedJaggedTensor,
        subs: list[KeyedJaggedTensor],
        routed: list[Routed | None],
        error: Exception | None,
        header: Tensor,
        header_work: Waitable | None,
        tag: BatchTag | None = None,
    ) -> None:
        self.features = features
        self._groups, self._env, self._stream = groups, env, stream
        self._kjt, self._subs, self._routed, self._error = kjt, subs, routed, error
        self._header, self._header_work, self._tag = header, header_work, tag
        self._progressed = False
        self._failure: Exception | None = None
        self._batch_sizes: list[int] = []
        self._recv_values: list[list[int]] = []
        self._pending: list[PendingExchange | KeyedJaggedTensor] = []

    def progress(self) -> None:
        """Wait for the header, then issue the id all-to-alls (async). Idempotent; never raises.

        Every rank that started the handle must progress it (a rank that skipped it would
        leave the others' all-to-alls unmatched); :meth:`wait` and :meth:`drain` do.
        """
        if self._progressed:
            return
        self._progressed = True
        with on_stream(self._stream):
            if self._header_work is not None:
                self._header_work.wait()
            recv = self._header.cpu()
            try:
                self._batch_sizes, self._recv_values = _read_header(recv, self._error, self._env, len(self._groups))
                if self._tag is not None:
                    self._tag.check(recv[:, 2 + len(self._groups) :].tolist(), self._env.rank)
            except (KeyError, ValueError, ShardingError) as e:  # every rank sees the flag: none issues more
                self._failure = e
                return
            self._pending = _issue_exchanges(
                self._groups, self._subs, self._routed, self._recv_values, self._batch_sizes, self._env
            )

    @property
    def failure(self) -> Exception | None:
        """The error :meth:`wait` will raise (known once :meth:`progress` has read the header)."""
        return self._failure

    def wait(self) -> DistContext:
        """The batch's :class:`DistContext` (what :func:`distribute_inputs` returns); raises a bad batch's error."""
        self.progress()
        if self._failure is not None:
            raise self._failure
        with on_stream(self._stream):
            inputs = _finish_exchanges(self._groups, self._pending)
        ctx = DistContext(self._kjt, self._batch_sizes, inputs, self._subs, self._routed, self._recv_values)
        if self._stream is not None:
            _hand_over(ctx, self._stream)
        return ctx

    def drain(self) -> None:
        """Finish the collectives of a handle nobody will consume (no error raised)."""
        self.progress()
        for p in self._pending:
            if isinstance(p, PendingExchange):
                for w in p.works:
                    w.wait()
                p.works = []


def _split_and_route(
    features: KeyedJaggedTensor, split: Split, groups: Sequence[EmbeddingSharding]
) -> tuple[KeyedJaggedTensor, list[KeyedJaggedTensor], list[Routed | None], Exception | None]:
    routed: list[Routed | None] = []
    subs: list[KeyedJaggedTensor] = []
    try:
        kjt, subs = split(features)
        routed = [g.route(s) for g, s in zip(groups, subs, strict=True)]
    except (KeyError, ValueError) as e:
        return features, [], [], e
    return kjt, subs, routed, None


def _header(
    kjt: KeyedJaggedTensor, routed: list[Routed | None], error: Exception | None, world: int, num_groups: int
) -> Tensor:
    """``[W, 2 + G]`` int64: row ``d`` = (failed, batch size, ids for ``d`` per group)."""
    header = torch.zeros(world, 2 + num_groups, dtype=torch.long)
    if error is not None:
        header[:, 0] = 1
        return header
    header[:, 1] = kjt.stride()
    for i, r in enumerate(routed):
        if r is not None:
            header[:, 2 + i] = torch.tensor(r.value_splits, dtype=torch.long)
    return header


def _read_header(
    recv: Tensor, error: Exception | None, env: ShardingEnv, num_groups: int
) -> tuple[list[int], list[list[int]]]:
    """Every rank's batch size and, per group, the ids each source sends; raises if any rank failed."""
    if error is not None:
        raise error
    columns = recv.t().tolist()  # one read of the small header, column by column (no per-rank loop)
    if any(columns[0]):
        failed = [s for s, flag in enumerate(columns[0]) if flag]
        raise ShardingError(
            f"rank {env.rank}: ranks {failed} rejected their batch (see their error); stopping all ranks"
        )
    return columns[1], columns[2 : 2 + num_groups]


def _hand_over(ctx: DistContext, stream: torch.cuda.Stream) -> None:
    """Make the current stream wait for ``stream``'s work on ``ctx`` and keep its memory alive for it."""
    current = torch.cuda.current_stream(stream.device)
    if current == stream:
        return
    current.wait_stream(stream)
    for kjt in (ctx.local, *ctx.inputs, *ctx.subs):
        kjt.record_stream(current)
    for r in ctx.routed:
        if r is not None:
            for t in (r.lengths, r.values, r.weights, r.order):
                if t is not None:
                    t.record_stream(current)  # type: ignore[arg-type]
