"""What travels beside the shared-memory slots: records, point-to-point chunks, reserved pages.

* A **record** (32 bytes, through the FIFO to the destination) says, for op ``seq``, how many
  bytes of which wire dtype the sender put where (its slot, or point to point over the process
  group). The receiver checks them against what its own splits expect, so ranks that issue
  different all-to-alls (splits or dtypes that disagree) fail naming both sides instead of
  reading stale bytes.
* **Point-to-point chunks** (:class:`Sent`, :class:`RecvInto`): a chunk larger than a slot
  (both sides know: tag 0, posted when the op is issued) or one whose pages could not be
  reserved (only the sender knows; its record says so: :data:`SPILL_TAG`, received when the op
  completes, in op order on both sides).
* **Reserved pages** (:func:`reserve`): every page a slot uses is reserved with
  ``posix_fallocate`` before it is written, so a full ``/dev/shm`` is an ``OSError`` the
  caller handles, never a ``SIGBUS``; ``$LIGHTNING_SHARDREC_SHM_BYTES`` caps what one process
  reserves (across its transports).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

LIMIT_ENV = "LIGHTNING_SHARDREC_SHM_BYTES"
REC = struct.Struct("<qqqq")  # (op, last op consumed of the receiver's, bytes, wire dtype << 2 | route)
ACK_ONLY = -1  # a record's op when it only carries the ack
SLOT, BIG, SPILL = 0, 1, 2  # routes: the slot; point to point, too big for a slot; point to point, no pages
SPILL_TAG = 0x5348  # the point-to-point tag of a chunk whose pages could not be reserved
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)  # fmt: skip
_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}  # 0: another dtype (only the byte count is checked)
_ROUTES = ("its slot", "point to point (larger than a slot)", "point to point (no room in the slot)")

_lock = threading.Lock()
_reserved = 0  # bytes this process holds reserved in shared memory (open transports)


def _fresh_lock_in_child() -> None:
    """A forked child (a DataLoader worker) gets a lock no thread of its own holds (no deadlock at its exit)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


class Record(NamedTuple):
    """One op's chunk as its sender describes it."""

    seq: int
    nbytes: int
    code: int  # wire dtype << 2 | route

    @property
    def route(self) -> int:
        return self.code & 3


def code_of(wire: torch.dtype, route: int) -> int:
    return _CODE.get(wire, 0) << 2 | route


def describe(nbytes: int, code: int) -> str:
    dtype = _DTYPES[(code >> 2) - 1] if code >> 2 else "another dtype"
    return f"{nbytes} bytes of {dtype} through {_ROUTES[code & 3]}"


def check(rec: Record, seq: int, source: int, rank: int, nbytes: int, wire: torch.dtype, big: bool) -> None:
    """Raise unless ``rec`` is op ``seq``'s chunk of ``nbytes`` bytes of ``wire`` (the ranks' ops agree)."""
    if rec.seq != seq:
        raise RuntimeError(
            f"ShmTransport: rank {rank} expected op {seq} from rank {source} and got op {rec.seq}: ops must be "
            "issued in the same order on every rank and completed in issue order (one thread per transport)"
        )
    sent, wanted = rec.code >> 2, _CODE.get(wire, 0)
    dtype_ok = sent == wanted or 0 in (sent, wanted)
    if rec.nbytes != nbytes or not dtype_ok or (rec.route == BIG) != big:
        want = describe(nbytes, code_of(wire, BIG if big else SLOT))
        raise RuntimeError(
            f"ShmTransport: op {seq}: rank {source} sent rank {rank} {describe(rec.nbytes, rec.code)}, while rank "
            f"{rank} expects {want}: the ranks issued different all-to-alls (their splits or dtypes disagree)"
        )


def limit() -> int | None:
    """``$LIGHTNING_SHARDREC_SHM_BYTES`` as bytes (None: only the filesystem limits)."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{LIMIT_ENV} must be a number of bytes >= 0, got {text!r}")
    return value


def reserve(fd: int, offset: int, nbytes: int) -> None:
    """Reserve the pages of ``[offset, offset + nbytes)`` of ``fd``; ``OSError`` (ENOSPC) when there is no room."""
    global _reserved
    cap = limit()
    with _lock:
        if cap is not None and _reserved + nbytes > cap:
            raise OSError(errno.ENOSPC, f"{_reserved + nbytes} bytes would exceed {LIMIT_ENV}={cap}")
        os.posix_fallocate(fd, offset, nbytes)
        _reserved += nbytes


def release(nbytes: int) -> None:
    """Give back ``nbytes`` counted by :func:`reserve` (the transport holding them closed)."""
    global _reserved
    with _lock:
        _reserved = max(0, _reserved - nbytes)


class Sent:
    """An ``isend`` that keeps its (possibly cast) buffer alive until waited on."""

    def __init__(self, buf: Tensor, pg: dist.ProcessGroup | None, dst: int, tag: int = 0) -> None:
        self.buf = buf
        self.work = dist.isend(buf, group=pg, group_dst=dst, tag=tag)

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        return True


class RecvInto:
    """An ``irecv`` into a wire-dtype buffer, cast into ``out`` when waited on."""

    def __init__(
        self, tmp: Tensor, pg: dist.ProcessGroup | None, src: int, out: Tensor, start: int, tag: int = 0
    ) -> None:
        self.tmp, self.out, self.start = tmp, out, start
        self.work = dist.irecv(tmp, group=pg, group_src=src, tag=tag)

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        if self.tmp.data_ptr() != self.out[self.start :].data_ptr():
            self.out[self.start : self.start + self.tmp.numel()].copy_(self.tmp)
        return True
