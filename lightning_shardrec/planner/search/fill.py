"""Fill: cut one table (or one column piece of it) over ranks, sized to their remaining time and memory.

``RankLoads`` keeps every rank's step time and free memory, sorted by load. A
``Strip`` is what one fill cuts: the table's columns into column shards, or some of
its columns into row blocks inside one host (table_row_wise, grid pieces). row_wise
is not sized: :func:`fill_all_rows` gives every rank an equal contiguous block.
``fill`` takes the emptiest ranks in turn, each up to
the target step time and its free memory (closed form: every cost and storage term
is affine in a shard's rows or columns), and sizes the shards to level the loads
(water filling) or to fill the ranks in turn (McNaughton's wrap-around rule).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from lightning_shardrec.planner.costs.perf import Workload, holder_output_seconds, shard_perf
from lightning_shardrec.planner.costs.storage import shard_storage
from lightning_shardrec.planner.plans.tables import COLUMN_ALIGN, TableSpec
from lightning_shardrec.planner.plans.types import ShardingType
from lightning_shardrec.planner.search.enumerate import Affine, TableOptions

# Step times within this relative margin count as a tie, broken by memory balance.
TIE_EPS = 1e-3
# fill_host_rows first tries the hosts of the emptiest ranks, this many of them.
_NEAR_HOSTS = 4


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One shard being placed: a ``rows x cols`` rectangle at ``(row_offset, col_offset)``."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    cost: float
    mem: int


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A table's sharding type and its shards, in shard order.

    ``charges``: seconds that fall on ranks besides their shards' own, ``(rank, seconds)``
    (the holders' output of table_row_wise / grid pieces, :func:`~.perf.holder_output_seconds`).
    """

    table: TableSpec
    kind: ShardingType
    pieces: tuple[Piece, ...]
    charges: tuple[tuple[int, float], ...] = ()

    @property
    def total_cost(self) -> float:
        return sum(p.cost for p in self.pieces) + sum(c for _, c in self.charges)

    def charge(self, ranks: RankLoads) -> None:
        """Add every shard's cost and memory, and the charges, to ``ranks``."""
        for p in self.pieces:
            ranks.add(p.rank, p.cost, p.mem)
        for r, c in self.charges:
            ranks.add(r, c, 0)


class RankLoads:
    """Per-rank step time and free memory, with ranks kept sorted by load."""

    def __init__(self, loads: Sequence[float], free: Sequence[float]) -> None:
        self.load = list(loads)
        self.free = list(free)
        self.order = sorted((load, r) for r, load in enumerate(self.load))

    def add(self, rank: int, cost: float, mem: int) -> None:
        del self.order[bisect_left(self.order, (self.load[rank], rank))]
        self.load[rank] += cost
        self.free[rank] -= mem
        insort(self.order, (self.load[rank], rank))

    def best_fit(
        self, cost: float, mem: int, limit: float, cands: Sequence[int] | None
    ) -> int | None:
        """The fullest rank (lowest id on ties) where ``cost`` and ``mem`` still fit."""
        if cands is not None:
            fits = [r for r in cands if self.load[r] + cost <= limit and self.free[r] >= mem]
            return max(fits, key=lambda r: (self.load[r], -r)) if fits else None
        i = bisect_right(self.order, (limit - cost, math.inf)) - 1
        while i >= 0:
            r = self.order[i][1]
            if self.free[r] >= mem:
                return r
            i -= 1
        return None

    def spread_fit(
        self, cost: float, mem: int, limit: float, cands: Sequence[int] | None
    ) -> int | None:
        """The least-loaded rank where ``cost`` and ``mem`` fit; among ranks within
        ``TIE_EPS`` of that load, the one with the most free memory (lowest id on ties)."""
        pool = self.order if cands is None else sorted((self.load[r], r) for r in cands)
        best: int | None = None
        ceiling = math.inf
        for load, r in pool:
            if load + cost > limit or load > ceiling:
                break
            if self.free[r] < mem:
                continue
            if best is None:
                ceiling = load + TIE_EPS * (load + cost)
                best = r
            elif self.free[r] > self.free[best]:
                best = r
        return best

    def snapshot(self, ranks: Iterable[int]) -> dict[int, tuple[float, float]]:
        return {r: (self.load[r], self.free[r]) for r in ranks}

    def restore(self, saved: dict[int, tuple[float, float]]) -> None:
        """Put back the loads and free memory of a :meth:`snapshot` (undo tentative adds exactly)."""
        for r, (load, free) in saved.items():
            del self.order[bisect_left(self.order, (self.load[r], r))]
            self.load[r], self.free[r] = load, free
            insort(self.order, (load, r))

    def emptiest(self, cands: Iterable[int] | None) -> list[int]:
        if cands is None:
            return [r for _, r in self.order]
        return sorted(cands, key=lambda r: (self.load[r], r))


def make_piece(
    t: TableSpec,
    work: Workload,
    kind: ShardingType,
    rank: int,
    row0: int,
    rows: int,
    col0: int,
    cols: int,
) -> Piece:
    """A ``rows x cols`` shard of ``t`` at ``(row0, col0)`` on ``rank``, costed."""
    return Piece(
        rank=rank,
        row_offset=row0,
        rows=rows,
        col_offset=col0,
        cols=cols,
        cost=shard_perf(t, work, kind, rows, cols),
        mem=shard_storage(t, work, kind, rows, cols),
    )


def _greedy_fill(
    total: int, minimum: int, align: int, caps: list[int], loads: list[float], cost: Affine
) -> list[int]:
    """Fill the ranks to their caps in order, keeping ``minimum`` for each later piece."""
    sizes = [minimum] * len(caps)
    left = total - minimum * len(caps)
    for step in (align, 1):
        for i, cap in enumerate(caps):
            give = min((cap - sizes[i]) // step * step, left // step * step)
            sizes[i] += give
            left -= give
    return sizes if left == 0 and all(s <= c for s, c in zip(sizes, caps, strict=True)) else []


def _water_fill(
    total: int, minimum: int, align: int, caps: list[int], loads: list[float], cost: Affine
) -> list[int]:
    """Split ``total`` into ``len(caps)`` sizes in ``[minimum, cap]`` that level the final loads."""

    def size_at(level: float, i: int) -> float:
        return (
            min(max((level - loads[i] - cost.fixed) / cost.slope, minimum), caps[i])
            if cost.slope > 0
            else caps[i]
        )

    lo = min(loads) + cost.fixed
    hi = max(loads[i] + cost.at(caps[i]) for i in range(len(caps)))
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(size_at(mid, i) for i in range(len(caps))) >= total:
            hi = mid
        else:
            lo = mid
    sizes = [max(minimum, int(size_at(hi, i)) // align * align) for i in range(len(caps))]
    sizes = [min(s, c) for s, c in zip(sizes, caps, strict=True)]
    left = total - sum(sizes)
    while left < 0:  # rounding up to ``minimum`` overshot: take back from the largest
        i = max(range(len(sizes)), key=lambda j: (sizes[j] - minimum, -j))
        take = min(sizes[i] - minimum, -left)
        sizes[i] -= take
        left += take
    by_load = sorted(range(len(sizes)), key=lambda j: (loads[j] + cost.at(sizes[j]), j))
    for step in (align, 1):
        for i in by_load:
            room = (caps[i] - sizes[i]) // step * step
            give = min(room, left // step * step)
            sizes[i] += give
            left -= give
    return sizes if left == 0 else []


@dataclass(frozen=True, kw_only=True)
class Strip:
    """What one fill cuts: ``width`` columns from ``col0`` cut into row blocks, or all
    columns cut into column shards (``by_cols``); ``cost`` / ``mem`` per row or column."""

    kind: ShardingType
    by_cols: bool
    col0: int
    width: int
    cost: Affine
    mem: Affine


def strip(opt: TableOptions, kind: ShardingType) -> Strip:
    """The whole table as one strip: column shards (column_wise) or full-width row blocks."""
    by_cols = kind is ShardingType.COLUMN_WISE
    return Strip(
        kind=kind,
        by_cols=by_cols,
        col0=0,
        width=opt.table.dim,
        cost=opt.col_cost if by_cols else opt.row_cost[kind],
        mem=opt.col_mem if by_cols else opt.row_mem[kind],
    )


def fill(
    opt: TableOptions,
    work: Workload,
    cut: Strip,
    ranks: RankLoads,
    limit: float,
    order: Sequence[int],
    level: bool,
    count: int | None = None,
) -> Placement | None:
    """Cut ``cut`` over the fewest ranks of ``order`` (emptiest first) that hold it under ``limit``.

    ``count``: over exactly the first ``count`` ranks of ``order`` that can take a share (None if they cannot hold it).
    """
    t = opt.table
    by_cols = cut.by_cols
    total = t.dim if by_cols else t.rows
    # row blocks over ``count`` ranks: each at least half of an equal share (never a 1-row sliver)
    minimum = t.min_partition if by_cols else max(1, -(-total // (2 * count)) if count else 1)
    align = COLUMN_ALIGN if by_cols and t.dim % COLUMN_ALIGN == 0 else 1
    cost, mem = cut.cost, cut.mem
    chosen: list[int] = []
    caps: list[int] = []
    for r in order:
        fit = min(
            cost.largest_within(limit - ranks.load[r]), mem.largest_within(ranks.free[r] * 0.999999)
        )
        cap = int(min(fit, total)) // align * align if fit < total else total
        if cap < minimum:
            continue
        chosen.append(r)
        caps.append(cap)
        if sum(caps) >= total and (count is None or len(chosen) == count):
            break
        if len(chosen) == count:
            return None
    else:
        return None
    if len(chosen) > 1 and total < minimum * len(chosen):
        return None
    sizing = _water_fill if level else _greedy_fill
    sizes = sizing(total, minimum, align, caps, [ranks.load[r] for r in chosen], cost)
    if not sizes:
        return None
    pieces, offset = [], 0
    assigned = list(zip(chosen, sizes, strict=True))
    if not by_cols:
        assigned.sort()  # row blocks in rank order
    for r, size in assigned:
        if size == 0:
            continue
        row0, col0 = (0, offset) if by_cols else (offset, cut.col0)
        rows, cols = (t.rows, size) if by_cols else (size, cut.width)
        piece = make_piece(t, work, cut.kind, r, row0, rows, col0, cols)
        if piece.mem > ranks.free[r]:
            return None
        pieces.append(piece)
        offset += size
    return Placement(table=t, kind=cut.kind, pieces=tuple(pieces))


def fill_all_rows(
    opt: TableOptions,
    work: Workload,
    ranks: RankLoads,
    limit: float,
    cands: Sequence[int] | None,
) -> Placement | None:
    """row_wise (TorchRec's meaning): contiguous row blocks on every rank, in rank order.

    Every rank (or every rank of the table's ``ranks`` constraint, the explicit way to row-block
    over fewer) holds one block; blocks differ by at most one row, so their memory is balanced
    (``20,000,000`` rows on 2 ranks: ``10,000,000`` each). A table with fewer rows than ranks has
    one row on each of its first ``rows`` ranks. A dynamic table's blocks are whole buckets
    (near-equal bucket counts; on its first ``num_buckets`` ranks when it has fewer buckets).
    None when a block exceeds its rank's time under ``limit`` or its free memory.
    """
    t = opt.table
    # a dynamic table's blocks are whole buckets: near-equal bucket counts, unit = slots per bucket
    unit = t.slots_per_bucket or 1
    units = t.num_buckets or t.rows
    holders = (sorted(cands) if cands is not None else list(range(len(ranks.load))))[:units]
    base, extra = divmod(units, len(holders))
    sized = {n * unit: make_piece(t, work, ShardingType.ROW_WISE, 0, 0, n * unit, 0, t.dim) for n in {base, base + 1}}
    pieces, offset = [], 0
    for i, r in enumerate(holders):
        size = (base + (i < extra)) * unit
        piece = replace(sized[size], rank=r, row_offset=offset)
        if ranks.load[r] + piece.cost > limit or piece.mem > ranks.free[r]:
            return None
        pieces.append(piece)
        offset += size
    return Placement(table=t, kind=ShardingType.ROW_WISE, pieces=tuple(pieces))


def fill_host_rows(
    opt: TableOptions,
    work: Workload,
    cut: Strip,
    ranks: RankLoads,
    limit: float,
    cands: Sequence[int] | None,
    level: bool,
) -> Placement | None:
    """Row blocks of ``cut`` on ranks of one host, trying hosts by their room under ``limit``.

    The hosts of the emptiest ranks go first (``_NEAR_HOSTS`` of them, most room first),
    then the rest: a scan of every host per table would dominate planning on large clusters.
    In a host, :func:`_fill_holders` sizes the blocks with their holders' output included.
    """
    topo = work.topology
    # blocks cost at least one block of every row plus the output of one holder (k = 1 moves least)
    needed = cut.cost.at(opt.table.rows) + holder_output_seconds(opt.table, work, cut.width, 1)
    allowed = None if cands is None else set(cands)
    near: list[int] = []
    for _, r in ranks.order:
        h = topo.host_of(r)
        if (allowed is None or r in allowed) and h not in near:
            near.append(h)
            if len(near) == _NEAR_HOSTS:
                break
    rest = [h for h in range(topo.num_hosts) if h not in set(near)]
    for batch in (near, rest):
        tries = []
        for h in batch:
            members = [r for r in topo.host_ranks(h) if allowed is None or r in allowed]
            gap = sum(limit - ranks.load[r] for r in members if ranks.load[r] < limit)
            if members and gap >= needed:
                tries.append((-gap, h, members))
        for _, _, members in sorted(tries):
            placed = _fill_holders(opt, work, cut, ranks, limit, ranks.emptiest(members), level)
            if placed is not None:
                return placed
    return None


def _fill_holders(
    opt: TableOptions,
    work: Workload,
    cut: Strip,
    ranks: RankLoads,
    limit: float,
    members: list[int],
    level: bool,
) -> Placement | None:
    """Blocks of ``cut`` on the fewest of ``members`` that hold it, each holder charged its output.

    A holder's output depends on how many holders there are (``k``), and all of them together
    pay more the larger ``k`` is: try ``k = 1, 2, ...`` and keep the first that fits, its
    blocks sized with ``k``'s charge on exactly ``k`` ranks.
    """
    for k in range(1, min(len(members), opt.table.rows) + 1):
        shared = holder_output_seconds(opt.table, work, cut.width, k)
        charged = replace(cut, cost=replace(cut.cost, fixed=cut.cost.fixed + shared))
        placed = fill(opt, work, charged, ranks, limit, members, level, count=k)
        if placed is not None and len(placed.pieces) == k:
            holders = sorted(p.rank for p in placed.pieces)
            exact = [holder_output_seconds(opt.table, work, cut.width, k, r, i) for i, r in enumerate(holders)]
            charges = tuple(zip(holders, exact, strict=True)) if shared > 0 else ()
            return Placement(table=placed.table, kind=placed.kind, pieces=placed.pieces, charges=charges)
    return None
