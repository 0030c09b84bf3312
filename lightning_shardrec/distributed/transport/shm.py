"""All-to-alls between ranks of one host through shared memory (``comm_transport="shm"``).

On CPU, two gloo ranks on one machine move an all-to-all through loopback TCP: the
caller hands the buffers to a gloo thread, which hands them to a socket thread, the
kernel copies the bytes twice, and the peer's threads hand them back. With 2 ranks
on 2 cores those threads take CPU from compute and every hand-off waits for a time
slice. :class:`ShmTransport` moves the same bytes through ``/dev/shm``:

* each rank owns one region (a sparse file, mapped by every peer): ``SLOTS`` slots per
  destination of ``slot_bytes`` each. Op ``n`` writes its chunk for ``d`` into slot
  ``n % SLOTS`` of ``d``'s part (casting to the wire dtype in the same copy), then
  writes a 16-byte record ``(n, ack)`` into a FIFO to ``d``;
* the receiver blocks in ``poll()`` on its FIFOs (no spinning), then copies the chunk out
  of the sender's region. Ops complete in issue order, and ``ack`` is the last op the
  sender has completed, so a slot is rewritten only after its reader is done with it.
  Before issuing op ``n`` a rank completes its own ops up to ``n - SLOTS``; a rank that
  must wait for an ack first sends its own (an ack-only record), so two ranks waiting for
  each other's acks both move on;
* each record also carries the chunk's byte count, wire dtype and route; the receiver checks
  them against its own splits (:mod:`.records`), so ranks whose ops disagree fail naming both
  sides instead of reading stale bytes;
* a chunk larger than ``slot_bytes`` goes point to point over the process group instead
  (both sides know its size, so they agree without asking);
* pages: :func:`~lightning_shardrec.distributed.transport.connect.connect` reserves the first
  ``reserved`` bytes of every slot (``posix_fallocate``: a full ``/dev/shm`` fails there, and
  every rank keeps the process group); a slot grows on demand, and when its pages cannot be
  reserved (``/dev/shm`` full, ``$LIGHTNING_SHARDREC_SHM_BYTES``) that chunk goes point to point
  and its record says so: a full ``/dev/shm`` slows a run, it never stops it (no ``SIGBUS``);
* a peer that dies closes its FIFO ends: the waiting rank raises "connection closed by
  peer" at once; a peer that hangs is caught by the group's timeout (and, in the
  strategy, by the heartbeat watchdog).

Ordering invariant: every rank issues the same ops on a transport in the same order, from one
thread, and completes them in issue order (``wait()`` on an op completes every earlier one first);
each record names its op, checked on arrival. A transport is never shared by two process groups'
users (the strategy gives the dense all-reduce and the pipeline their own).

:func:`~lightning_shardrec.distributed.transport.connect.connect` builds one (collective) only when
every rank of a gloo group can open the others' files and sees the same bytes; otherwise every
rank gets None and keeps the process group. All files are unlinked as soon as every rank has
opened them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import mmap
import os
import select
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.distributed.transport import records
from lightning_shardrec.distributed.transport.records import ACK_ONLY, BIG, REC, SLOT, SPILL, SPILL_TAG, Record

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
SLOTS = 4  # ops in flight per destination; op n reuses op n - SLOTS's slot
SLOT_BYTES = 64 << 20  # virtual (sparse) bytes per slot and destination; pages are reserved on first use
RESERVED_BYTES = 1 << 20  # bytes of every slot reserved at connect (a /dev/shm without them: the process group)
PROBE = 4096  # a page at the start of each region: the owner's token, read back by every peer
_OPEN: weakref.WeakSet[ShmTransport] = weakref.WeakSet()


@dataclass
class _Op:
    """One issued all-to-all: where each source's rows land and what is still in flight."""

    seq: int
    out: Tensor  # flat
    recv: list[tuple[int, int, int, bool]]  # per source: (element offset in out, elements, wire bytes, too big)
    wire: torch.dtype
    p2p: list[records.Sent | records.RecvInto] = field(default_factory=list)
    done: bool = False


class ShmWork:
    """The handle of an issued :meth:`ShmTransport.all_to_all`: ``wait()`` as ``dist.Work``'s."""

    def __init__(self, transport: ShmTransport, op: _Op) -> None:
        self._transport, self._op = transport, op

    def wait(self) -> bool:
        """Complete this op (and every op issued before it on this transport); True."""
        if not self._op.done:
            self._transport.complete_through(self._op.seq)
        return True

    def is_completed(self) -> bool:
        return self._op.done


class ShmTransport:
    """Shared-memory all-to-alls among the ``world_size`` ranks of ``pg`` (see the module docstring).

    Made by :func:`~lightning_shardrec.distributed.transport.connect.connect`; every rank must issue the same
    ops in the same order, as on a process group.
    """

    #: the ``comm_transport`` that attaches one again (for a new group over the same ranks)
    mode = "shm"

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        own: tuple[int, mmap.mmap],
        peers: dict[int, mmap.mmap],
        fifos: tuple[dict[int, int], dict[int, int]],
        slot_bytes: int,
        timeout: float,
        reserved: int = 0,
    ) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.slot_bytes, self.timeout = slot_bytes, timeout
        self.spilled = 0  # chunks that went point to point because their pages could not be reserved
        self._fd, self._own_map = own
        self._peer_maps = peers
        self._inbound, self._outbound = fifos  # source -> read fd, destination -> write fd
        part = SLOTS * slot_bytes
        # this rank's slots for destination d, and source s's slots for this rank, as byte tensors
        self._send = {d: torch.frombuffer(self._own_map, dtype=torch.uint8, offset=PROBE + d * part, count=part)
                      for d in peers}  # fmt: skip
        self._recv = {s: torch.frombuffer(m, dtype=torch.uint8, count=part) for s, m in peers.items()}
        self._allocated = dict.fromkeys(((d, k) for d in peers for k in range(SLOTS)), reserved)  # by connect
        self._no_room = slot_bytes + 1  # the smallest size a reservation failed for (not tried again)
        self._next = 0
        self._pending: collections.deque[_Op] = collections.deque()
        self._records: dict[int, collections.deque[Record]] = {s: collections.deque() for s in peers}
        self._acked = dict.fromkeys(peers, -1)  # last op of this rank's each destination has consumed
        self._sent_ack = dict.fromkeys(peers, -1)  # the last such ack this rank sent each peer
        self._consumed = -1  # last op this rank has completed
        self._buffers = dict.fromkeys(peers, b"")
        self._gone: set[int] = set()  # sources whose FIFO reached end of file
        self._poll = select.poll()
        for fd in self._inbound.values():
            self._poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._by_fd = {fd: s for s, fd in self._inbound.items()}
        self.closed = False
        self._held = [sum(self._allocated.values())]  # bytes reserved (given back at close)
        self._finalizer = weakref.finalize(self, _close, self._fds(), self._held)
        _OPEN.add(self)

    # --- ops ----------------------------------------------------------------------------------
    def all_to_all(
        self,
        out: Tensor,
        inp: Tensor,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
        wire: torch.dtype | None = None,
    ) -> ShmWork:
        """``dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)`` through shared memory.

        Splits count rows (dim 0; None: equal). ``wire``: the dtype on the wire (e.g. bf16 for
        fp32 tensors, cast inside the copies); default ``inp``'s. ``out`` is valid after ``wait()``.
        """
        if self.closed:
            raise RuntimeError("ShmTransport: all_to_all on a closed transport (or on the copy a forked child got)")
        if not out.is_contiguous():
            raise ValueError(f"ShmTransport.all_to_all: out must be contiguous, got strides {out.stride()}")
        w = self.world_size
        row = math.prod(inp.shape[1:])  # elements per row
        in_rows = in_splits if in_splits is not None else _equal(inp, w, "inp", self.rank)
        out_rows = out_splits if out_splits is not None else _equal(out, w, "out", self.rank)
        wire = wire or inp.dtype
        size = wire.itemsize
        src, dst = inp.contiguous().view(-1), out.view(-1)
        n = self._next
        self._next += 1
        while self._pending and self._pending[0].seq <= n - SLOTS:  # keep at most SLOTS - 1 of ours in flight
            self._complete(self._pending.popleft())
        deadline = time.monotonic() + self.timeout
        k = n % SLOTS
        op = _Op(n, dst, [], wire)
        start = 0
        sent: dict[int, tuple[int, int]] = {}  # destination -> (bytes, route)
        for d, rows in enumerate(in_rows):
            count = rows * row
            chunk = src[start : start + count]
            start += count
            if d == self.rank:
                mine = sum(out_rows[: self.rank]) * row
                dst[mine : mine + count].copy_(chunk if wire == chunk.dtype else chunk.to(wire))  # rounded alike
                continue
            route = BIG if count * size > self.slot_bytes else SLOT  # too big: point to point (the receiver knows)
            if route == SLOT:
                if self._acked[d] < n - SLOTS:  # its reader is not done with op n - SLOTS's slot yet
                    self._await_ack(d, n - SLOTS, deadline)
                slot = self._slot(d, k, count * size)
                if slot is None:  # no pages: point to point, and the record tells the receiver
                    route = SPILL
                    self.spilled += 1
                else:
                    slot.view(wire).copy_(chunk)
            if route != SLOT:
                op.p2p.append(records.Sent(chunk.to(wire).contiguous(), self.pg, d, SPILL_TAG if route == SPILL else 0))
            sent[d] = (count * size, route)
        for d in self._outbound:  # every destination gets a record, also for an empty or p2p chunk
            self._write(d, n, sent[d][0], records.code_of(wire, sent[d][1]))
        start = 0
        for s, rows in enumerate(out_rows):
            count = rows * row
            if s != self.rank:
                big = count * size > self.slot_bytes
                if big:
                    tmp = dst[start : start + count] if wire == dst.dtype else dst.new_empty(count, dtype=wire)
                    op.p2p.append(records.RecvInto(tmp, self.pg, s, dst, start))
                op.recv.append((start, count, count * size, big))
            start += count
        self._pending.append(op)
        return ShmWork(self, op)

    def reduce_scatter(self, x: Tensor, rows: list[int]) -> Tensor:
        """Row block ``r`` of ``x`` (``x.split(rows)[r]``) summed over ranks onto rank ``r``, in rank order."""
        mine, w = rows[self.rank], self.world_size
        recv = x.new_empty((w * mine, *x.shape[1:]))
        self.all_to_all(recv, x, [mine] * w, rows).wait()
        return _sum_in_rank_order(recv.view(w, mine, *x.shape[1:]))

    def all_gather(self, x: Tensor, rows: list[int]) -> Tensor:
        """Every rank's ``x`` (``rows[r]`` rows on rank ``r``) stacked in rank order."""
        w = self.world_size
        out = x.new_empty((sum(rows), *x.shape[1:]))
        copies = x.expand(w, *x.shape).reshape(-1, *x.shape[1:])  # this rank's rows once per destination
        self.all_to_all(out, copies, rows, [x.shape[0]] * w).wait()
        return out

    def all_reduce(self, t: Tensor) -> None:
        """Sum the contiguous ``t`` over ranks in place: rank ``r`` sums chunk ``r`` in rank order, then every
        rank gathers the chunks (the same bits everywhere)."""
        w, flat = self.world_size, t.view(-1)
        n = flat.numel()
        chunks = [n // w + (1 if i < n % w else 0) for i in range(w)]
        summed = self.reduce_scatter(flat, chunks)
        flat.copy_(self.all_gather(summed, chunks))

    def complete_through(self, seq: int) -> None:
        """Complete every op issued up to ``seq`` (in issue order)."""
        while self._pending and self._pending[0].seq <= seq:
            self._complete(self._pending.popleft())

    def _complete(self, op: _Op) -> None:
        deadline = time.monotonic() + self.timeout
        sources = [s for s in range(self.world_size) if s != self.rank]
        for s, (start, count, nbytes, big) in zip(sources, op.recv, strict=True):
            while not self._records[s]:
                self._read(deadline, waiting_for=s)
            rec = self._records[s].popleft()
            records.check(rec, op.seq, s, self.rank, nbytes, op.wire, big)
            if rec.route == SPILL:  # the sender had no room for its pages: in op order on both sides
                tmp = op.out.new_empty(count, dtype=op.wire)
                records.RecvInto(tmp, self.pg, s, op.out, start, SPILL_TAG).wait()
            elif rec.route == SLOT and nbytes > 0:
                base = (op.seq % SLOTS) * self.slot_bytes
                view = self._recv[s][base : base + nbytes].view(op.wire)
                op.out[start : start + count].copy_(view)
        for w in op.p2p:
            w.wait()
        self._consumed = op.seq
        op.done = True

    # --- slots and records --------------------------------------------------------------------
    def _slot(self, d: int, k: int, nbytes: int) -> Tensor | None:
        """Bytes ``[0, nbytes)`` of slot ``k`` for ``d``, its pages reserved first; None when they cannot be."""
        have = self._allocated[(d, k)]
        if nbytes > have:
            if nbytes >= self._no_room:
                return None
            offset = PROBE + (d * SLOTS + k) * self.slot_bytes
            for grow in dict.fromkeys((min(self.slot_bytes, max(nbytes, 2 * have)), nbytes)):  # doubling, else exact
                try:
                    records.reserve(self._fd, offset + have, grow - have)
                except OSError as e:
                    error = e
                    continue
                self._allocated[(d, k)] = grow
                self._held[0] += grow - have
                break
            else:
                if self._no_room > self.slot_bytes:  # the first time
                    log.warning(
                        "ShmTransport: cannot reserve %d more bytes in %s (%s): chunks that do not fit go through the "
                        "process group (give %s more room for full speed)", nbytes - have, SHM_DIR, error, SHM_DIR
                    )  # fmt: skip
                self._no_room = nbytes
                return None
        base = k * self.slot_bytes
        return self._send[d][base : base + nbytes]

    def _await_ack(self, d: int, seq: int, deadline: float) -> None:
        """Block until ``d`` has consumed this rank's op ``seq``. Every peer first learns what this rank has
        consumed (an ack-only record), so two ranks waiting for each other's acks both move on."""
        for peer, sent in self._sent_ack.items():
            if sent < self._consumed:
                self._write(peer, ACK_ONLY)
        while self._acked[d] < seq:
            self._read(deadline, waiting_for=d)

    def _write(self, d: int, seq: int, nbytes: int = 0, code: int = 0) -> None:
        self._sent_ack[d] = self._consumed
        try:
            os.write(self._outbound[d], REC.pack(seq, self._consumed, nbytes, code))  # < PIPE_BUF: atomic
        except BrokenPipeError as e:  # the reader is gone
            raise _gone(d) from e

    def _read(self, deadline: float, waiting_for: int) -> None:
        """Block until some source's records arrive; raise when ``waiting_for`` is gone or at the timeout."""
        if waiting_for in self._gone:
            raise _gone(waiting_for)
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"ShmTransport: timed out after {self.timeout:.0f} s waiting for rank {waiting_for} of the group"
            )
        for fd, _ in self._poll.poll(max(1, int(left * 1000))):
            s = self._by_fd[fd]
            data = os.read(fd, 1 << 16)
            if not data:  # every write end closed: the peer exited (its records before that were read)
                self._gone.add(s)
                self._poll.unregister(fd)
                continue
            buf = self._buffers[s] + data
            whole = len(buf) - len(buf) % REC.size
            for seq, ack, nbytes, code in REC.iter_unpack(buf[:whole]):
                if seq != ACK_ONLY:
                    self._records[s].append(Record(seq, nbytes, code))
                self._acked[s] = max(self._acked[s], ack)
            self._buffers[s] = buf[whole:]

    def close(self) -> None:
        """Release the FIFOs (peers blocked on this rank then see it gone); mappings go with the last view.
        Idempotent; the strategy closes its transports at teardown and the pipeline its own at close."""
        self.closed = True
        self._finalizer()

    def _fds(self) -> list[int]:
        return [*self._inbound.values(), *self._outbound.values(), self._fd]


def _sum_in_rank_order(blocks: Tensor) -> Tensor:
    """``blocks[0] + blocks[1] + ...`` (a fixed order: every rank and run adds alike)."""
    out = blocks[0].clone()
    for b in blocks[1:]:
        out += b
    return out


def _gone(rank: int) -> RuntimeError:
    """The error of a collective whose peer exited (``is_comm_failure`` knows its words)."""
    return RuntimeError(f"ShmTransport: connection closed by peer (rank {rank} of the group exited)")


def _close(fds: list[int], held: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    records.release(held[0])


def _equal(t: Tensor, world: int, name: str, rank: int) -> list[int]:
    """Equal splits of ``t``'s rows (no splits given), refused when they do not divide (no row dropped)."""
    if t.shape[0] % world:
        raise ValueError(
            f"ShmTransport.all_to_all on rank {rank}: {name} has {t.shape[0]} rows, not a multiple of the "
            f"{world} ranks; pass explicit splits"
        )
    return [t.shape[0] // world] * world


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) must not hold a rank's FIFO ends: its death would go unseen."""
    for t in list(_OPEN):
        t.close()


os.register_at_fork(after_in_child=_close_in_child)
