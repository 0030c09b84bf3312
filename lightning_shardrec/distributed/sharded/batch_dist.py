"""The input distribution every sharded collection shares, now or ahead of time.

:func:`distribute_inputs` runs it for the batch at hand. :func:`start_input_dist`
starts it for a *later* batch with ``async_op=True`` collectives and returns a
:class:`PrefetchHandle`; the collection's ``forward`` waits on the handle when it
gets the very KJT object the handle was started for. Both send the same header and
the same all-to-alls, so they produce the same :class:`DistContext`::

    prefetch(kjt_{i+1})      header all-to-all issued (async)
    forward(kjt_i)           ... batch i's compute overlaps it ...
    handle.progress()        header waited on; lengths + ids + weights issued (async, one all-to-all)
    backward(batch i)        ... overlaps the id all-to-all ...
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

from lightning_shardrec.distributed.comm.collectives import (
    ShardingEnv,
    Waitable,
    exchange_header,
    exchange_header_async,
    on_stream,
)
from lightning_shardrec.distributed.comm.input_dist import PackedExchange, Routed, exchange_packed_async
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


class IdCheck(Protocol):
    """The ids' range check done on the device (see :class:`~lightning_shardrec.modules.features.IdRanges`)."""

    def out_of_range(self, features: KeyedJaggedTensor) -> Tensor:
        """0-d bool on the ids' device, no host sync: whether any id is outside its table."""
        ...

    def explain(self, features: KeyedJaggedTensor) -> None:
        """Raise the named error (table, feature, id, range) for ``features``' first bad id."""
        ...


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
    ids: IdCheck | None = None,
) -> DistContext:
    """The input distribution, now.

    ``split`` checks the batch and cuts it into one KJT per group. Every rank then sends
    one small header (its batch size, its id count per group and destination, a
    failure flag) before any bulk collective, so a bad batch on one rank stops every
    rank with an error instead of a hang; ``tag``'s ints ride along and are checked the same
    way. Then every group's lengths, ids and weights travel in ONE all-to-all (bytes, issued
    async), as :meth:`PrefetchHandle.progress` does: two collectives per batch in all.

    ``ids``: the id check on the device; its flag rides in the header (a bad id stops every rank
    before any lookup, and the rank holding it raises the named error). The header is this
    step's one read of the device (with the KJT's per-key lengths, the input's only host syncs):
    the ids each rank sends a row-wise group are counted on the device and ride in it too.
    """
    kjt, subs, routed, error, bad = _split_and_route(features, split, groups, ids)
    header = _header(kjt, routed, error, env.world_size, len(groups), device, tag, bad)
    rows, sent = _read_rows(exchange_header(header, env), header)
    batch_sizes, recv_values = _read_header(rows, sent, error, env, len(groups), _explainer(ids, kjt))
    _fill_value_splits(routed, sent)
    if tag is not None:
        tag.check([r[2 + len(groups) :] for r in rows], env.rank)
    pending = _issue_exchanges(groups, subs, routed, recv_values, batch_sizes, env)
    return DistContext(kjt, batch_sizes, _finish_exchanges(groups, pending), subs, routed, recv_values)


@dataclass
class _Issued:
    """In flight: per group its input when nothing crosses the wire (else None), and the rest's one all-to-all."""

    local: list[KeyedJaggedTensor | None]
    packed: PackedExchange | None


def _issue_exchanges(
    groups: Sequence[EmbeddingSharding],
    subs: list[KeyedJaggedTensor],
    routed: list[Routed | None],
    recv_values: list[list[int]],
    batch_sizes: list[int],
    env: ShardingEnv,
) -> _Issued:
    """Every routing group's ids in ONE all-to-all, issued (async); the others' inputs made here."""
    local = [
        g.input_dist(s, r, v, batch_sizes) if r is None else None
        for g, s, r, v in zip(groups, subs, routed, recv_values, strict=True)
    ]
    moving = [i for i, r in enumerate(routed) if r is not None]
    if not moving:
        return _Issued(local, None)
    sent, keys = [routed[i] for i in moving], [groups[i].received_keys() for i in moving]
    return _Issued(local, exchange_packed_async(sent, [recv_values[i] for i in moving], keys, batch_sizes, env))  # type: ignore[arg-type]


def _finish_exchanges(groups: Sequence[EmbeddingSharding], issued: _Issued) -> list[KeyedJaggedTensor]:
    """Each group's kernel input: waits for the exchange :func:`_issue_exchanges` started."""
    received = iter([] if issued.packed is None else issued.packed.wait())
    return [g.after_exchange(next(received)) if x is None else x for g, x in zip(groups, issued.local, strict=True)]


def start_input_dist(
    features: KeyedJaggedTensor,
    split: Split,
    groups: Sequence[EmbeddingSharding],
    env: ShardingEnv,
    device: torch.device,
    tag: BatchTag | None = None,
    ids: IdCheck | None = None,
) -> PrefetchHandle:
    """The input distribution, started: local checks and routing now, the header all-to-all issued async.

    A bad batch does not raise here: the failure flag travels in the header and
    :meth:`PrefetchHandle.wait` raises on every rank, as :func:`distribute_inputs` would.
    On CUDA the work is queued on the current stream (the caller's side stream).
    """
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    kjt, subs, routed, error, bad = _split_and_route(features, split, groups, ids)
    header = _header(kjt, routed, error, env.world_size, len(groups), device, tag, bad, ahead=True)
    recv, work = exchange_header_async(header, env)
    handle = PrefetchHandle(features, groups, env, stream, kjt, subs, routed, error, recv, work, tag)
    handle.sent, handle.explain = header, _explainer(ids, kjt)
    return handle


def start_end_of_data(
    groups: Sequence[EmbeddingSharding], env: ShardingEnv, device: torch.device, tag: BatchTag
) -> EndOfData:
    """Where the other ranks prefetch their next batch and this rank has none: send a header saying so (async)."""
    header = torch.zeros(env.world_size, 2 + len(groups), dtype=torch.long)
    recv, work = exchange_header_async(_to_device(_with_tag(header, tag, ahead=True, ended=True), device), env)
    return EndOfData(recv, work, tag, env, len(groups))


class EndOfData:
    """The header of :func:`start_end_of_data` in flight; :meth:`wait` raises unless every rank's data ended too."""

    def __init__(self, header: Tensor, work: Waitable | None, tag: BatchTag, env: ShardingEnv, groups: int) -> None:
        self._header, self._work, self._tag, self._env, self._groups = header, work, tag, env, groups

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        rows = self._header.tolist()  # the one read
        _read_header(rows, None, None, self._env, self._groups)
        self._tag.check([r[2 + self._groups :] for r in rows], self._env.rank)


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
        self._pending = _Issued([], None)
        #: the header this rank sent (read with the received one), and the named id error's source
        self.sent: Tensor | None = None
        self.explain: Callable[[], None] | None = None
        #: identity and in-place version of the KJT's tensors when its ids were sent (set by the collection)
        self.versions: tuple[tuple[int, int] | None, ...] = (None, None, None, None)

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
            rows, sent = _read_rows(self._header, self.sent)
            try:
                g = len(self._groups)
                self._batch_sizes, self._recv_values = _read_header(rows, sent, self._error, self._env, g, self.explain)
                _fill_value_splits(self._routed, sent)
                if self._tag is not None:
                    self._tag.check([r[2 + g :] for r in rows], self._env.rank)
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
        if self._pending.packed is not None:
            self._pending.packed.drain()


def _split_and_route(
    features: KeyedJaggedTensor, split: Split, groups: Sequence[EmbeddingSharding], ids: IdCheck | None
) -> tuple[KeyedJaggedTensor, list[KeyedJaggedTensor], list[Routed | None], Exception | None, Tensor | None]:
    """The local work: split, the ids' device flag (None: no device check), each group's routing."""
    routed: list[Routed | None] = []
    subs: list[KeyedJaggedTensor] = []
    try:
        kjt, subs = split(features)
        bad = None if ids is None else ids.out_of_range(kjt)
        routed = [g.route(s) for g, s in zip(groups, subs, strict=True)]
    except (KeyError, ValueError) as e:
        return features, [], [], e, None
    return kjt, subs, routed, None, bad


def _explainer(ids: IdCheck | None, kjt: KeyedJaggedTensor) -> Callable[[], None] | None:
    return None if ids is None else lambda: ids.explain(kjt)


def _header(
    kjt: KeyedJaggedTensor,
    routed: list[Routed | None],
    error: Exception | None,
    world: int,
    num_groups: int,
    device: torch.device,
    tag: BatchTag | None,
    bad_ids: Tensor | None,
    ahead: bool = False,
) -> Tensor:
    """``[W, 2 + G (+ tag)]`` int64 on ``device``: row ``d`` = (failed, batch size, ids for ``d`` per group,
    ``tag``'s ints). What the host knows is built on the host and copied without blocking; a row-wise
    group's counts and the ids' flag are written on the device (read back with the received header)."""
    header = torch.zeros(world, 2 + num_groups, dtype=torch.long)
    if error is not None:
        header[:, 0] = 1
    else:
        header[:, 1] = kjt.stride()
        for i, r in enumerate(routed):
            if r is not None and r.value_counts is None:
                header[:, 2 + i] = torch.tensor(r.value_splits, dtype=torch.long)
    header = _to_device(_with_tag(header, tag, ahead=ahead), device)
    if error is None:
        for i, r in enumerate(routed):
            if r is not None and r.value_counts is not None:
                header[:, 2 + i] = r.value_counts
        if bad_ids is not None:
            header[:, 0] = bad_ids
    return header


def _read_rows(recv: Tensor, sent: Tensor | None) -> tuple[list[list[int]], list[list[int]] | None]:
    """The received header's rows and the sent one's, in one read of the device (the step's host sync)."""
    if sent is None:
        return recv.tolist(), None
    both = torch.cat([recv, sent]).tolist()
    return both[: recv.shape[0]], both[recv.shape[0] :]


def _fill_value_splits(routed: list[Routed | None], sent: list[list[int]] | None) -> None:
    """Each row-wise group's ids per destination, from the header this rank sent."""
    for i, r in enumerate(routed):
        if r is not None and r.value_counts is not None and sent is not None:
            r.value_splits = [row[2 + i] for row in sent]


def _read_header(
    rows: list[list[int]],
    sent: list[list[int]] | None,
    error: Exception | None,
    env: ShardingEnv,
    num_groups: int,
    explain: Callable[[], None] | None = None,
) -> tuple[list[int], list[list[int]]]:
    """Every rank's batch size and, per group, the ids each source sends; raises if any rank failed:
    this rank's own error (a bad id: named by ``explain``), else a note naming the ranks that failed."""
    if error is not None:
        raise error
    if sent is not None and sent[0][0] and explain is not None:
        explain()  # raises the named error
    columns = [list(c) for c in zip(*rows, strict=True)]
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
