"""Partition: place every table's shards on ranks to minimise the slowest rank.

Binary search on a target step time ``T``. For one ``T``, tables go in decreasing
cost: a table that fits whole goes table-wise to the fullest rank it still fits
(best fit); otherwise it is cut, filling the emptiest ranks up to ``T`` with column
shards, row blocks inside one host, or a grid (column pieces, each in row
blocks inside one host), each sized in closed form to the rank's remaining time and
memory (see :mod:`~lightning_shardrec.planner.search.fill`), and the cut with the least total
work wins; row_wise, TorchRec's meaning, puts an equal contiguous block on every rank
(:func:`~lightning_shardrec.planner.search.fill.fill_all_rows`). The best plan over all targets is kept.

Best fit packs equal-cost tables onto as few ranks as it can, whatever their size. So
once the fastest step time ``T*`` is known, one more pass spreads the tables instead
(each whole table to the least-loaded rank, near-equal loads going to the rank with the
most free memory) under ``T* * (1 + TIE_EPS)``; it replaces the best plan when it keeps
to that time and leaves more memory free on the fullest rank.

With measured rates (``Topology(rates=...)``) a plan also pays per plan: its collective calls, its
sharding groups and its pieces (:func:`~lightning_shardrec.planner.machine.rates.step_estimate`), which no
rank's load shows. The planner then passes a ``score`` (the plan's step estimate), and the plan the
loads alone pick competes with the best the search finds by that score and with the best plan of
whole tables: cutting a table to level the ranks can cost more than it saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_shardrec.planner.costs.perf import Workload
from lightning_shardrec.planner.plans.tables import TableSpec
from lightning_shardrec.planner.plans.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.planner.search.enumerate import TableOptions
from lightning_shardrec.planner.search.fill import (
    TIE_EPS,
    Piece,
    Placement,
    RankLoads,
    fill,
    fill_all_rows,
    fill_host_rows,
    strip,
)
from lightning_shardrec.planner.search.grid import fill_grid

_SEARCH_STEPS = 40
_SEARCH_TOLERANCE = 1e-3

#: how good a candidate plan is (lower is better): by default its slowest rank's load
Score = Callable[[list[Placement], RankLoads], float]


def makespan(placed: list[Placement], ranks: RankLoads) -> float:
    return max(ranks.load)


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
        cut = strip(opt, ShardingType.COLUMN_WISE)
        tries.append(fill(opt, work, cut, ranks, limit, ranks.emptiest(cands), level))
    if opt.allows(ShardingType.ROW_WISE):
        tries.append(fill_all_rows(opt, work, ranks, limit, cands))
    if opt.allows(ShardingType.TABLE_ROW_WISE):
        whole = strip(opt, ShardingType.TABLE_ROW_WISE)
        tries.append(fill_host_rows(opt, work, whole, ranks, limit, cands, level))
    if opt.allows(ShardingType.GRID_SHARD):
        tries.append(fill_grid(opt, work, ranks, limit, cands, level))
    done = [p for p in tries if p is not None]
    return min(done, key=lambda p: p.total_cost) if done else None


def _order(options: Sequence[TableOptions]) -> list[TableOptions]:
    """Pinned tables first (least freedom), then by decreasing cost, then decreasing memory;
    ties by key (deterministic)."""
    return sorted(options, key=lambda o: (o.table.ranks is None, -o.tw_cost, -o.tw_mem, o.table.key))


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
        placement.charge(ranks)
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
    score: Score,
) -> tuple[list[Placement], RankLoads] | None:
    best: tuple[list[Placement], RankLoads] | None = None
    best_score = math.inf
    for _ in range(_SEARCH_STEPS):
        if hi <= lo * (1 + _SEARCH_TOLERANCE):
            break
        mid = math.sqrt(lo * hi)
        placed, failed, ranks = pack(options, work, base_load, free, mid, level=level)
        if failed:
            lo = mid
            continue
        scored = score(placed, ranks)
        if scored < best_score:
            best, best_score = (placed, ranks), scored
        hi = min(mid, max(ranks.load))
    return best


def partition(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    lower_bound: float,
    score: Score = makespan,
) -> tuple[list[Placement], list[TableOptions], RankLoads]:
    """Search the smallest step time every table fits under; keep the best plan found.

    Two ways to size a cut are searched: level the loads of the ranks it lands on, or
    fill them to the target in turn (McNaughton). Returns (placements, tables that fit
    nowhere even without a time limit, loads). With a ``score`` other than the slowest rank's
    load, three plans compete on it: the plan the load alone picks, the best the search finds by
    ``score``, and the same with every table whole where table_wise is allowed.
    """
    best = _partition(options, work, base_load, free, lower_bound, makespan)
    if score is makespan or best[1]:
        return best
    whole = [replace(o, kinds=(ShardingType.TABLE_WISE,)) if o.allows(ShardingType.TABLE_WISE) else o for o in options]
    best_score = score(best[0], best[2])
    for opts in (options, whole):
        found = _partition(opts, work, base_load, free, lower_bound, score)
        scored = math.inf if found[1] else score(found[0], found[2])
        if scored < best_score:
            best, best_score = found, scored
    return best


def _partition(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    lower_bound: float,
    score: Score,
) -> tuple[list[Placement], list[TableOptions], RankLoads]:
    placed, failed, ranks = pack(options, work, base_load, free, math.inf, keep_going=True)
    if failed or not options:
        return placed, failed, ranks
    best, best_ranks = placed, ranks
    best_score = score(placed, ranks)
    lo = max(lower_bound, max(base_load), 1e-30)
    for level in (True, False):
        found = _search(options, work, base_load, free, lo, max(best_ranks.load), level, score)
        scored = math.inf if found is None else score(*found)
        if found is not None and scored < best_score:
            (best, best_ranks), best_score = found, scored
    return _spread(options, work, base_load, free, best, best_ranks, score)


def _spread(
    options: Sequence[TableOptions],
    work: Workload,
    base_load: Sequence[float],
    free: Sequence[float],
    best: list[Placement],
    best_ranks: RankLoads,
    score: Score = makespan,
) -> tuple[list[Placement], list[TableOptions], RankLoads]:
    """Break a step-time tie by memory: keep the spread plan if it is within ``TIE_EPS``
    of the best step time (its score) and leaves more memory free on its fullest rank."""
    limit = max(best_ranks.load) * (1 + TIE_EPS)
    within = score(best, best_ranks) * (1 + TIE_EPS)
    for level in (True, False):
        placed, failed, ranks = pack(options, work, base_load, free, limit, level=level, spread=True)
        if not failed and score(placed, ranks) <= within and min(ranks.free) > min(best_ranks.free):
            best, best_ranks = placed, ranks
    return best, [], best_ranks


def as_sharding(p: Placement) -> ParameterSharding:
    """The ``ParameterSharding`` of a placed table (fused kernel)."""
    shards = [ShardMetadata((x.row_offset, x.col_offset), (x.rows, x.cols), x.rank) for x in p.pieces]
    return ParameterSharding(p.kind, EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards)


def data_parallel_sharding(spec: TableSpec, world_size: int) -> ParameterSharding:
    """A replicated table: the whole of it on every rank."""
    shards = [ShardMetadata((0, 0), (spec.rows, spec.dim), r) for r in range(world_size)]
    return ParameterSharding(ShardingType.DATA_PARALLEL, EmbeddingComputeKernel.DENSE, list(range(world_size)), shards)


def placed_shards(
    specs: list[TableSpec], result: dict[tuple[str, str], ParameterSharding]
) -> list[tuple[TableSpec, ShardingType, list[tuple[int, int, int, int]]]]:
    """Per table: its spec, sharding type and shards ``(rank, col0, rows, cols)``."""
    out = []
    for spec in specs:
        ps = result[spec.key]
        shards = [(s.rank, s.shard_offsets[1], s.shard_sizes[0], s.shard_sizes[1]) for s in ps.shards]
        out.append((spec, ps.sharding_type, shards))
    return out
