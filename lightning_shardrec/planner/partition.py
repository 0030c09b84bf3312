"""Partition: place every table's shards on ranks to minimise the slowest rank.

Binary search on a target step time ``T``. For one ``T``, tables go in decreasing
cost: a table that fits whole goes table-wise to the fullest rank it still fits
(best fit); otherwise it is cut, filling the emptiest ranks up to ``T`` with column
shards, row blocks, or row blocks inside one host, each sized in closed form to the
rank's remaining time and memory (McNaughton's wrap-around rule), and the cut with
the least total work wins. The best plan over all targets is kept.

Best fit packs equal-cost tables onto as few ranks as it can, whatever their size. So
once the fastest step time ``T*`` is known, one more pass spreads the tables instead
(each whole table to the least-loaded rank, near-equal loads going to the rank with the
most free memory) under ``T* * (1 + TIE_EPS)``; it replaces the best plan when it keeps
to that time and leaves more memory free on the fullest rank.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_shardrec.planner.enumerate import Affine, TableOptions
from lightning_shardrec.planner.perf import Workload, shard_perf
from lightning_shardrec.planner.storage import shard_storage
from lightning_shardrec.planner.tables import COLUMN_ALIGN, TableSpec
from lightning_shardrec.planner.types import ShardingType

_SEARCH_STEPS = 40
_SEARCH_TOLERANCE = 1e-3
# Step times within this relative margin count as a tie, broken by memory balance.
TIE_EPS = 1e-3


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
    """A table's sharding type and its shards, in shard order."""

    table: TableSpec
    kind: ShardingType
    pieces: tuple[Piece, ...]

    @property
    def total_cost(self) -> float:
        return sum(p.cost for p in self.pieces)


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

    def emptiest(self, cands: Iterable[int] | None) -> list[int]:
        if cands is None:
            return [r for _, r in self.order]
        return sorted(cands, key=lambda r: (self.load[r], r))


def _piece(
    opt: TableOptions,
    work: Workload,
    kind: ShardingType,
    rank: int,
    row0: int,
    rows: int,
    col0: int,
    cols: int,
) -> Piece:
    t = opt.table
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


def _fill(
    opt: TableOptions,
    work: Workload,
    kind: ShardingType,
    ranks: RankLoads,
    limit: float,
    order: Sequence[int],
    level: bool,
) -> Placement | None:
    """Cut ``opt``'s table over the fewest ranks of ``order`` (emptiest first) that hold it under ``limit``."""
    t = opt.table
    by_cols = kind is ShardingType.COLUMN_WISE
    total = t.dim if by_cols else t.rows
    minimum = t.min_partition if by_cols else 1
    align = COLUMN_ALIGN if by_cols and t.dim % COLUMN_ALIGN == 0 else 1
    cost = opt.col_cost if by_cols else opt.row_cost[kind]
    mem = opt.col_mem if by_cols else opt.row_mem[kind]
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
        if sum(caps) >= total:
            break
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
        row0, col0 = (0, offset) if by_cols else (offset, 0)
        rows, cols = (t.rows, size) if by_cols else (size, t.dim)
        piece = _piece(opt, work, kind, r, row0, rows, col0, cols)
        if piece.mem > ranks.free[r]:
            return None
        pieces.append(piece)
        offset += size
    return Placement(table=t, kind=kind, pieces=tuple(pieces))


def _fill_host_rows(
    opt: TableOptions,
    work: Workload,
    ranks: RankLoads,
    limit: float,
    cands: Sequence[int] | None,
    level: bool,
) -> Placement | None:
    topo = work.topology
    allowed = set(range(topo.world_size) if cands is None else cands)
    hosts = []
    for h in range(topo.num_hosts):
        members = [r for r in topo.host_ranks(h) if r in allowed]
        if members:
            gap = sum(max(limit - ranks.load[r], 0.0) for r in members)
            hosts.append((-gap, h, members))
    for _, _, members in sorted(hosts):
        placed = _fill(
            opt, work, ShardingType.TABLE_ROW_WISE, ranks, limit, ranks.emptiest(members), level
        )
        if placed is not None:
            return placed
    return None


def place_table(
    opt: TableOptions,
    work: Workload,
    ranks: RankLoads,
    limit: float,
    level: bool = True,
    spread: bool = False,
) -> Placement | None:
    """Where ``opt``'s table goes under step-time ``limit``, or None if it cannot go anywhere.

    A whole table goes to the fullest rank it fits (best fit), or with ``spread`` to the
    least-loaded one, near-ties broken by free memory.
    """
    t = opt.table
    cands = t.ranks
    if opt.allows(ShardingType.TABLE_WISE):
        fit = ranks.spread_fit if spread else ranks.best_fit
        r = fit(opt.tw_cost, opt.tw_mem, limit, cands)
        if r is not None:
            piece = Piece(
                rank=r,
                row_offset=0,
                rows=t.rows,
                col_offset=0,
                cols=t.dim,
                cost=opt.tw_cost,
                mem=opt.tw_mem,
            )
            return Placement(table=t, kind=ShardingType.TABLE_WISE, pieces=(piece,))
    tries: list[Placement | None] = []
    if opt.allows(ShardingType.COLUMN_WISE):
        tries.append(
            _fill(opt, work, ShardingType.COLUMN_WISE, ranks, limit, ranks.emptiest(cands), level)
        )
    if opt.allows(ShardingType.ROW_WISE):
        tries.append(
            _fill(opt, work, ShardingType.ROW_WISE, ranks, limit, ranks.emptiest(cands), level)
        )
    if opt.allows(ShardingType.TABLE_ROW_WISE):
        tries.append(_fill_host_rows(opt, work, ranks, limit, cands, level))
    done = [p for p in tries if p is not None]
    return min(done, key=lambda p: p.total_cost) if done else None


def _order(options: Sequence[TableOptions]) -> list[TableOptions]:
    """Pinned tables first (least freedom), then by decreasing cost, then decreasing memory;
    ties by key (deterministic)."""
    return sorted(
        options, key=lambda o: (o.table.ranks is None, -o.tw_cost, -o.tw_mem, o.table.key)
    )


def pack(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    limit: float,
    keep_going: bool = False,
    level: bool = True,
    spread: bool = False,
) -> tuple[list[Placement], list[TableOptions], RankLoads]:
    """Place every table under ``limit``; returns (placements, tables that did not fit, loads)."""
    ranks = RankLoads(base_load, free)
    placed: list[Placement] = []
    failed: list[TableOptions] = []
    for opt in _order(options):
        placement = place_table(opt, work, ranks, limit, level, spread)
        if placement is None:
            failed.append(opt)
            if not keep_going:
                break
            continue
        for p in placement.pieces:
            ranks.add(p.rank, p.cost, p.mem)
        placed.append(placement)
    return placed, failed, ranks


def _search(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    lo: float,
    hi: float,
    level: bool,
) -> tuple[list[Placement], RankLoads] | None:
    best: tuple[list[Placement], RankLoads] | None = None
    for _ in range(_SEARCH_STEPS):
        if hi <= lo * (1 + _SEARCH_TOLERANCE):
            break
        mid = math.sqrt(lo * hi)
        placed, failed, ranks = pack(options, work, base_load, free, mid, level=level)
        if failed:
            lo = mid
            continue
        makespan = max(ranks.load)
        if best is None or makespan < max(best[1].load):
            best = (placed, ranks)
        hi = min(mid, makespan)
    return best


def partition(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    lower_bound: float,
) -> tuple[list[Placement], list[TableOptions], RankLoads]:
    """Search the smallest step time every table fits under; keep the best plan found.

    Two ways to size a cut are searched: level the loads of the ranks it lands on, or
    fill them to the target in turn (McNaughton). Returns (placements, tables that fit
    nowhere even without a time limit, loads).
    """
    placed, failed, ranks = pack(options, work, base_load, free, math.inf, keep_going=True)
    if failed or not options:
        return placed, failed, ranks
    best, best_ranks = placed, ranks
    lo = max(lower_bound, max(base_load), 1e-30)
    for level in (True, False):
        found = _search(options, work, base_load, free, lo, max(best_ranks.load), level)
        if found is not None and max(found[1].load) < max(best_ranks.load):
            best, best_ranks = found
    return _spread(options, work, base_load, free, best, best_ranks)


def _spread(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    best: list[Placement],
    best_ranks: RankLoads,
) -> tuple[list[Placement], list[TableOptions], RankLoads]:
    """Break a step-time tie by memory: keep the spread plan if it is within ``TIE_EPS``
    of the best step time and leaves more memory free on its fullest rank."""
    limit = max(best_ranks.load) * (1 + TIE_EPS)
    for level in (True, False):
        placed, failed, ranks = pack(options, work, base_load, free, limit, level=level, spread=True)
        if not failed and max(ranks.load) <= limit and min(ranks.free) > min(best_ranks.free):
            best, best_ranks = placed, ranks
    return best, [], best_ranks
