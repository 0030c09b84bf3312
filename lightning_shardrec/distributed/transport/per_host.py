"""Shared memory inside each host, the process group between hosts (``comm_transport="auto"``).

When the ranks of a gloo job cannot all share one ``/dev/shm`` (several nodes), :func:`connect_hosts`
finds the ranks that can (:func:`shm_hosts`: each rank leaves a token file under ``/dev/shm``
and reads the others'), gives each such host a
:class:`~lightning_shardrec.distributed.transport.shm.ShmTransport` over a group of its own ranks,
and returns a :class:`HostTransport`. Its all-to-all moves each chunk one of two ways::

    2 hosts x 2 ranks, rank 1's all_to_all:
      chunks for ranks 0, 1 (its host)    -> the host's shared memory (ShmTransport over {0, 1})
      chunks for ranks 2, 3 (other host)  -> isend / irecv on the job's process group

The received rows are the group's all-to-all's, bit for bit (each chunk is moved, never
summed); reductions are the transport's (sums in rank order, as :class:`ShmTransport`).
The ranks of a host must be consecutive (Lightning's layout: ``node_rank * devices + local_rank``).
:func:`transport_report` says, at fit start, which transport each host got and how many hosts
the plan assumed.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.transport import shm
from lightning_shardrec.distributed.transport.connect import connect, group_timeout
from lightning_shardrec.distributed.transport.records import RecvInto, Sent
from lightning_shardrec.distributed.transport.shm import ShmTransport, ShmWork


def shm_hosts(pg: dist.ProcessGroup | None = None) -> tuple[list[list[int]], list[str], str]:
    """Collective over ``pg``: ``(hosts, names, why)``: the ranks (of ``pg``) sharing one ``/dev/shm``
    (lists in rank order), each host's name (its first rank's hostname), and why they cannot be
    told apart ('' when they can; then ``hosts`` is empty)."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    unusable = "" if os.access(shm.SHM_DIR, os.W_OK) else f"no writable {shm.SHM_DIR}"
    infos = _gather((unusable, secrets.token_hex(8), socket.gethostname()), pg, world)
    failed = [f"rank {r}: {w}" for r, (w, _, _) in enumerate(infos) if w]
    if failed:
        return [], [], failed[0]
    base = os.path.join(shm.SHM_DIR, f"shardrec-hosts-{infos[0][1]}-r")
    mine, why = f"{base}{rank}", ""
    try:
        with open(mine, "x") as f:
            f.write(infos[rank][1])
    except OSError as e:  # a full /dev/shm, say
        why = f"cannot write in {shm.SHM_DIR}: {e}"
    try:
        failed = [f"rank {r}: {w}" for r, w in enumerate(_gather(why, pg, world)) if w]  # every token written
        seen = [s for s in range(world) if _read(f"{base}{s}") == infos[s][1]]
        views = _gather(seen, pg, world)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(mine)
    if failed:
        return [], [], failed[0]
    hosts: list[list[int]] = []
    for r, view in enumerate(views):
        if r not in view or any(views[s] != view for s in view):
            return [], [], f"ranks disagree on who shares {shm.SHM_DIR} (rank {r} sees ranks {view})"
        if view[0] == r:
            hosts.append(view)
    return hosts, [infos[h[0]][2] for h in hosts], ""


def connect_hosts(
    pg: dist.ProcessGroup | None = None, timeout: float | None = None
) -> tuple[HostTransport | None, str]:
    """Collective over ``pg``: ``(transport, "")`` with shared memory inside every host of several,
    else ``(None, why)`` on every rank (one host, one rank per host, a host without shared memory)."""
    hosts, names, why = shm_hosts(pg)
    if why:
        return None, why
    if len(hosts) == 1:
        return None, "every rank is on one host"
    if all(len(h) == 1 for h in hosts):
        return None, "one rank per host: nothing to share"
    scattered = [h for h in hosts if h != list(range(h[0], h[0] + len(h)))]
    if scattered:
        return None, f"the ranks of a host are not consecutive (ranks {scattered[0]} share memory)"
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    host = next(h for h in hosts if rank in h)
    local, why = None, ""
    sub = _host_group(pg, hosts, host)
    if sub is not None:
        local, why = connect(sub, timeout)
    failed = [f"rank {r}: {w}" for r, w in enumerate(_gather(why, pg, world)) if w]
    if failed:
        if local is not None:
            local.close()
        return None, failed[0]
    return HostTransport(pg, rank, world, local, hosts, names), ""


def _host_group(pg: dist.ProcessGroup | None, hosts: list[list[int]], host: list[int]) -> dist.ProcessGroup | None:
    """Collective: a gloo group of ``host``'s ranks (None for a one-rank host). Over the whole job every rank
    makes every host's group in the same order; over a part of it only the host's ranks take part."""
    ranks = dist.get_process_group_ranks(pg or dist.group.WORLD)
    timeout = timedelta(seconds=group_timeout(pg))
    if len(ranks) < dist.get_world_size():
        if len(host) == 1:
            return None
        return dist.new_group([ranks[r] for r in host], backend="gloo", timeout=timeout, use_local_synchronization=True)
    mine = None
    for h in hosts:
        if len(h) > 1:
            group = dist.new_group([ranks[r] for r in h], backend="gloo", timeout=timeout)
            mine = group if h == host else mine
    return mine


class HostTransport:
    """All-to-alls among the ranks of ``pg``: shared memory inside this rank's host, ``pg`` point to point
    between hosts (see the module docstring). Made by :func:`connect_hosts`."""

    #: the ``comm_transport`` that attaches one again (for a new group over the same ranks)
    mode = "auto"

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        local: ShmTransport | None,
        hosts: list[list[int]],
        names: list[str],
    ) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.local, self.hosts, self.names = local, hosts, names
        host = next(h for h in hosts if rank in h)
        self._lo, self._hi = host[0], host[-1] + 1  # this host's ranks: [lo, hi)
        self.closed = False

    def all_to_all(
        self,
        out: Tensor,
        inp: Tensor,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
        wire: torch.dtype | None = None,
    ) -> HostWork:
        """``dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)``, this host's chunks through
        shared memory. Splits count rows (None: equal); ``wire``: the dtype on the wire (default ``inp``'s)."""
        if self.closed:
            raise RuntimeError("HostTransport: all_to_all on a closed transport")
        if not out.is_contiguous():
            raise ValueError(f"HostTransport.all_to_all: out must be contiguous, got strides {out.stride()}")
        w, lo, hi = self.world_size, self._lo, self._hi
        row = math.prod(inp.shape[1:])
        in_rows = in_splits if in_splits is not None else [inp.shape[0] // w] * w
        out_rows = out_splits if out_splits is not None else [out.shape[0] // w] * w
        wire = wire or inp.dtype
        src, dst = inp.contiguous(), out.view(-1)
        in_at, out_at = _starts(in_rows), _starts(out_rows)
        p2p: list[Sent | RecvInto] = []
        for d in (*range(lo), *range(hi, w)):  # other hosts: point to point, issued first
            if in_rows[d]:
                p2p.append(Sent(src[in_at[d] : in_at[d + 1]].to(wire).contiguous(), self.pg, d))
            if out_rows[d]:
                start, count = out_at[d] * row, out_rows[d] * row
                tmp = dst[start : start + count] if wire == dst.dtype else dst.new_empty(count, dtype=wire)
                p2p.append(RecvInto(tmp, self.pg, d, dst, start))
        mine = out[out_at[lo] : out_at[hi]]
        if self.local is not None:
            work = self.local.all_to_all(mine, src[in_at[lo] : in_at[hi]], out_rows[lo:hi], in_rows[lo:hi], wire)
            return HostWork(work, p2p)
        chunk = src[in_at[self.rank] : in_at[self.rank + 1]]
        mine.copy_(chunk if wire == chunk.dtype else chunk.to(wire))  # rounded as on the wire
        return HostWork(None, p2p)

    # ShmTransport's reductions, built on this all_to_all (they use only rank, world_size and all_to_all)
    def reduce_scatter(self, x: Tensor, rows: list[int]) -> Tensor:
        """Row block ``r`` of ``x`` (``x.split(rows)[r]``) summed over ranks onto rank ``r``, in rank order."""
        return ShmTransport.reduce_scatter(self, x, rows)  # type: ignore[arg-type]

    def all_gather(self, x: Tensor, rows: list[int]) -> Tensor:
        """Every rank's ``x`` (``rows[r]`` rows on rank ``r``) stacked in rank order."""
        return ShmTransport.all_gather(self, x, rows)  # type: ignore[arg-type]

    def all_reduce(self, t: Tensor) -> None:
        """Sum the contiguous ``t`` over ranks in place (the same bits on every rank)."""
        ShmTransport.all_reduce(self, t)  # type: ignore[arg-type]

    def close(self) -> None:
        """Release this host's shared memory (the process group stays)."""
        self.closed = True
        if self.local is not None:
            self.local.close()


class HostWork:
    """The handle of :meth:`HostTransport.all_to_all`: ``wait()`` as ``dist.Work``'s."""

    def __init__(self, local: ShmWork | None, p2p: list[Sent | RecvInto]) -> None:
        self._local, self._p2p, self._done = local, p2p, False

    def wait(self) -> bool:
        if not self._done:
            if self._local is not None:
                self._local.wait()
            for op in self._p2p:
                op.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def transport_report(env: ShardingEnv) -> str:
    """Collective over ``env.pg``: the hosts the plan assumed and the transport each host got, e.g.::

    lightning_shardrec transport: the plan assumed 2 hosts x 2 ranks; the ranks run on 2 hosts
      host 'node-a' (ranks 0-1): shared memory
      host 'node-b' (ranks 2-3): shared memory
      between hosts: the process group (gloo)
    """
    transport = env.transport
    if isinstance(transport, HostTransport):
        hosts, names = transport.hosts, transport.names
    else:  # hosts by hostname
        seen = _gather(socket.gethostname(), env.pg, env.world_size)
        names = list(dict.fromkeys(seen))
        hosts = [[r for r, n in enumerate(seen) if n == name] for name in names]
    backend = dist.get_backend(env.pg)
    lines = [
        f"lightning_shardrec transport: the plan assumed {env.num_hosts} host{'s' * (env.num_hosts > 1)} x "
        f"{env.local_world_size} ranks; the ranks run on {len(hosts)} host{'s' * (len(hosts) > 1)}"
    ]
    for ranks, name in zip(hosts, names, strict=True):
        shared = transport is not None and (len(ranks) > 1 or not isinstance(transport, HostTransport))
        how = "shared memory" if shared else f"the process group ({backend})"
        lines.append(f"  host {name!r} (ranks {_span(ranks)}): {how}")
    if len(hosts) > 1:
        between = "shared memory" if isinstance(transport, ShmTransport) else f"the process group ({backend})"
        lines.append(f"  between hosts: {between}")
    assumed = [list(range(h, h + env.local_world_size)) for h in range(0, env.world_size, env.local_world_size)]
    if hosts != assumed:
        lines.append(
            f"  note: the plan's hosts ({', '.join(_span(h) for h in assumed)}) are not the ranks' "
            f"({', '.join(_span(h) for h in hosts)}); set Trainer(num_nodes=..., devices=...) to the cluster's"
        )
    return "\n".join(lines)


def _span(ranks: list[int]) -> str:
    """``[2, 3] -> "2-3"``, ``[1] -> "1"``, ``[0, 2] -> "0, 2"``."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _starts(rows: list[int]) -> list[int]:
    """Row offsets of each rank's block and the end: ``[2, 0, 3] -> [0, 2, 2, 5]``."""
    out = [0]
    for n in rows:
        out.append(out[-1] + n)
    return out


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read()
    return None


def _gather(info: object, pg: dist.ProcessGroup | None, world: int) -> list:  # type: ignore[type-arg]
    out: list[object] = [None] * world
    dist.all_gather_object(out, info, group=pg)
    return out
