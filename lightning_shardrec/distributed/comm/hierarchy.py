"""Holders-only reduction of row-blocked pooled outputs: summed inside a host, then sent home.

``L`` ranks per host (``ShardingEnv.local_world_size``); rank ``r = h*L + j`` is local rank
``j`` of host ``h``. A *unit* is a column piece of a table together with the ranks of one
host that hold its row blocks, its *holders* ``H`` (``k = |H|``). Every holder pools a
partial ``[sum_s B_s, cols]`` of the unit for the global batch (rows by source). The
sources are dealt to the holders in ``k`` contiguous chunks (source ``s`` to holder
``s*k // W``), and two all-to-alls with uneven splits bring every source its sums::

    W = 4, L = 2, a unit on ranks {0, 1} of host 0 (k = 2): chunk 0 = sources {0, 1}, chunk 1 = {2, 3}
      (1) host all-to-all: rank 0 sends rank 1 its rows of sources 2, 3 and gets rank 1's rows
          of sources 0, 1; each adds them to its own: rank 0 holds the sums [B_0+B_1, cols]
      (2) world all-to-all: rank 0 sends [B_0, cols] to itself and [B_1, cols] to rank 1;
          rank 1 sends [B_2, cols] to rank 2 and [B_3, cols] to rank 3
      -> each source puts every unit's columns in the group's lane order (adds them where
         one piece has holders on several hosts)

Ranks that hold no block of a unit send and receive nothing for it; a rank with no block
at all joins both all-to-alls with empty splits. Per holder, step (1) sends ``(k-1)/k`` of
its ``[B_global, cols]`` partial inside the host and step (2) ``1/k`` of it to the sources.
Backward runs the same all-to-alls in reverse (the gradient of a sum: the chunk's gradient
sent to each of its ``k`` contributors).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.distributed.comm.bounded_cache import BoundedCache
from lightning_shardrec.distributed.comm.collectives import CommPrecision, ShardingEnv, all_to_all_grad, uses_cuda
from lightning_shardrec.distributed.comm.groups import cached_group
from lightning_shardrec.distributed.comm.qcomm import WirePrecision
from lightning_shardrec.planner.machine.mesh import built_mesh


def host_group(env: ShardingEnv) -> ShardingEnv:
    """Collective over ``env``'s ranks (every rank, same order): this rank's host (rank = local index).

    One host reuses ``env``'s group; one rank per host needs none. On the default group, the host
    mesh's ``"local"`` group (:func:`~lightning_shardrec.planner.machine.mesh.host_mesh`); on another group
    every rank creates all ``H`` host groups (same backend, ``env``'s timeout).
    """
    local, hosts = env.local_world_size, env.num_hosts
    if hosts == 1:
        return env
    if local == 1:
        return ShardingEnv(0, 1, None, 1)
    if env.pg is None or env.pg is dist.group.WORLD:
        mesh = built_mesh(env.world_size, local)
        if mesh is not None:  # the host mesh's per-host group (ShardingEnv.from_process_group built it)
            group = mesh.get_group("local")
            return ShardingEnv(dist.get_rank(group), local, group, local)
    ranks = dist.get_process_group_ranks(env.pg or dist.group.WORLD)  # group rank -> global rank
    backend, timeout = dist.get_backend(env.pg), _timeout(env.pg)
    layout = [[ranks[h * local + j] for j in range(local)] for h in range(hosts)]
    host = cached_group(
        ("host", str(backend), tuple(map(tuple, layout))),
        lambda: dist.new_subgroups_by_enumeration(layout, timeout=timeout, backend=backend)[0],
    )
    out = ShardingEnv(dist.get_rank(host), local, host, local)
    if out.rank != env.rank % local:
        raise RuntimeError(
            f"host_group: rank {env.rank} got local index {out.rank}, expected {env.rank % local}; "
            "the process group's global ranks must increase with its group ranks"
        )
    return out


def _timeout(pg: dist.ProcessGroup | None) -> timedelta | None:
    """The collective timeout of ``pg``'s backend, when torch exposes it (else the default)."""
    group = pg or dist.group.WORLD
    device = torch.device("cuda" if uses_cuda(pg) else "cpu")
    try:
        return group._get_backend(device).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class Unit:
    """A piece's blocks on one host: ``holders`` (ranks, ascending), its group output ``columns``,
    and ``local``: its columns ``[a, b)`` of this rank's kernel output (None: not a holder)."""

    holders: tuple[int, ...]
    columns: tuple[int, ...]
    local: tuple[int, int] | None

    def owner(self, source: int, world: int) -> int:
        """Index in ``holders`` of the holder that sums ``source``'s rows."""
        return source * len(self.holders) // world

    def chunk(self, c: int, world: int) -> range:
        """The sources holder ``c`` sums: a contiguous range, ``W/k`` of them (+-1)."""
        k = len(self.holders)
        return range(-(-c * world // k), -(-(c + 1) * world // k))


class HolderExchange:
    """The two all-to-alls of the module docstring, planned once for this rank's ``units``."""

    def __init__(
        self,
        units: list[Unit],
        width: int,
        env: ShardingEnv,
        host: ShardingEnv,
        device: torch.device,
        precision: CommPrecision | WirePrecision = CommPrecision.FP32,
    ) -> None:
        rank, world, local = env.rank, env.world_size, env.local_world_size
        self.env, self.host, self.width, self.precision = env, host, width, precision
        self.units = units
        self.mine = [u for u, unit in enumerate(units) if rank in unit.holders]
        self.index = {u: units[u].holders.index(rank) for u in self.mine}
        self.h0 = h0 = rank - rank % local
        # step (1): per local rank q, the units both hold (not to itself: its own rows stay)
        self.pairs = [[u for u in self.mine if h0 + q in units[u].holders and h0 + q != rank] for q in range(local)]
        self.host_active = host.world_size > 1 and any(
            len(x.holders) > 1 and x.holders[0] // local == rank // local for x in units
        )
        # step (2): per source, my units whose chunk it is in; per sender, its units whose chunk I am in
        self.send_to = [[u for u in self.mine if units[u].owner(s, world) == self.index[u]] for s in range(world)]
        self.recv_from = [
            [u for u, x in enumerate(units) if r in x.holders and x.owner(rank, world) == x.holders.index(r)]
            for r in range(world)
        ]
        cols = [c for us in self.recv_from for u in us for c in units[u].columns]
        self.exclusive = sorted(cols) == list(range(width))
        if sorted(set(cols)) != list(range(width)):
            missing = sorted(set(range(width)) - set(cols))
            raise ValueError(f"HolderExchange: output columns {missing} of {width} come from no unit")
        self._cols = torch.tensor(cols, dtype=torch.long)
        self._device = device
        self._plans: BoundedCache[_Plan] = BoundedCache()  # per batch-size signature (one in a steady run)

    def _plan(self, batch_sizes: list[int]) -> _Plan:
        """The splits, row spans and output placement for these batch sizes (built once, then reused)."""
        world, units = self.env.world_size, self.units
        offsets = [0]
        for b in batch_sizes:
            offsets.append(offsets[-1] + b)

        def rows(u: int, c: int) -> tuple[int, int]:
            chunk = units[u].chunk(c, world)
            return offsets[chunk.start], offsets[chunk.stop]

        def cols(u: int) -> int:
            return len(units[u].columns)

        own = [(u, rows(u, self.index[u]), units[u].local) for u in self.mine]
        host_send, host_in, host_out, host_recv = [], [], [], []
        if self.host_active:
            for q, us in enumerate(self.pairs):
                theirs = [rows(u, units[u].holders.index(self.h0 + q)) for u in us]
                host_send += [(span, units[u].local) for u, span in zip(us, theirs, strict=True)]
                host_in.append(sum(_n(span) * cols(u) for u, span in zip(us, theirs, strict=True)))
                host_out.append(sum(_n(rows(u, self.index[u])) * cols(u) for u in us))
                host_recv += [(self.mine.index(u), _n(rows(u, self.index[u])) * cols(u), cols(u)) for u in us]
        world_send = []
        for s, us in enumerate(self.send_to):
            for u in us:
                lo = offsets[s] - rows(u, self.index[u])[0]
                world_send.append((self.mine.index(u), lo, lo + batch_sizes[s]))
        whole = len(self.mine) == 1 and [(a, b) for _, a, b in world_send] == [(0, _n(own[0][1]))]
        b = batch_sizes[self.env.rank]
        # output position of every received value: [b, w] blocks side by side -> [b, width]
        widths = [cols(u) for us in self.recv_from for u in us]
        starts = torch.tensor([0, *widths]).cumsum(0)[:-1]
        block = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths, dtype=torch.long) * b)
        within = torch.arange(int(block.numel())) - torch.repeat_interleave(starts * b, torch.tensor(widths) * b)
        w_of = torch.tensor(widths)[block]
        column = self._cols[starts[block] + within % w_of]
        pos = (within // w_of) * self.width + column
        if self.exclusive:
            pos = torch.empty_like(pos).index_put_((pos,), torch.arange(pos.numel()))  # out[p] = recv[inverse[p]]
        return _Plan(
            own=own,
            host_send=host_send,
            host_splits=(host_out, host_in),
            host_recv=host_recv,
            world_send=world_send,
            whole=whole,
            world_splits=(
                [b * sum(cols(u) for u in us) for us in self.recv_from],
                [batch_sizes[s] * sum(cols(u) for u in us) for s, us in enumerate(self.send_to)],
            ),
            pos=pos.to(self._device),
            rows=b,
        )

    def __call__(self, partial: Tensor, batch_sizes: list[int]) -> Tensor:
        """``partial [sum_s B_s, D_local]`` (this rank's kernel output) -> ``[B_r, width]`` summed."""
        plan = self._plans.get(tuple(batch_sizes), lambda: self._plan(batch_sizes))
        own = [_slice(partial, span, local) for _, span, local in plan.own]
        anchor = partial.reshape(-1)[:0]  # keeps every rank's collectives in the graph
        if self.host_active:
            send = [anchor, *(_slice(partial, span, local).reshape(-1) for span, local in plan.host_send)]
            recv = all_to_all_grad(torch.cat(send), *plan.host_splits, self.host, self.precision)
            anchor = recv[:0]
            for (i, _, w), part in zip(plan.host_recv, recv.split([n for _, n, _ in plan.host_recv]), strict=True):
                own[i] = own[i] + part.view(-1, w)
        if plan.whole:  # one unit here: its rows are already in source order
            send_buffer = torch.cat([anchor, own[0].reshape(-1)])
        else:
            send_buffer = torch.cat([anchor, *(own[i][lo:hi].reshape(-1) for i, lo, hi in plan.world_send)])
        recv = all_to_all_grad(send_buffer, *plan.world_splits, self.env, self.precision)
        if self.exclusive:
            return recv.index_select(0, plan.pos).view(plan.rows, self.width)
        return recv.new_zeros(plan.rows * self.width).index_add(0, plan.pos, recv).view(plan.rows, self.width)


@dataclass(frozen=True)
class _Plan:
    """:class:`HolderExchange`'s bookkeeping for one batch-size signature."""

    own: list[tuple[int, tuple[int, int], tuple[int, int] | None]]  # (unit, rows, local columns) per unit held
    host_send: list[tuple[tuple[int, int], tuple[int, int] | None]]  # step (1): (rows, columns) pieces sent
    host_splits: tuple[list[int], list[int]]  # step (1): (out, in) splits
    host_recv: list[tuple[int, int, int]]  # step (1): (index into own, numel, columns) per piece received
    world_send: list[tuple[int, int, int]]  # step (2): (index into own, first row, end row) per piece sent
    whole: bool  # step (2) sends own[0] whole
    world_splits: tuple[list[int], list[int]]  # step (2): (out, in) splits
    pos: Tensor  # exclusive: out[p] = recv[pos[p]]; else out[pos[i]] += recv[i]
    rows: int  # this rank's batch size


def _n(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _slice(partial: Tensor, span: tuple[int, int], local: tuple[int, int] | None) -> Tensor:
    a, b = local  # type: ignore[misc]
    return partial[span[0] : span[1], a:b]
