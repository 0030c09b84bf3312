"""Grid cuts: a table cut into column pieces, each piece row-blocked over ranks of one host.

The 2-D cut TorchRec calls ``grid_shard``. Each piece is placed like a table_row_wise
table (:func:`~lightning_shardrec.planner.search.fill.fill_host_rows`), after the pieces before
it, so the pieces of one table spread over the emptiest ranks; different pieces may
land on different hosts. Every column cut of :func:`~lightning_shardrec.planner.search.enumerate.column_cuts`
is tried and the cheapest in total work wins (each piece's output, charged to its holders, included)::

    dim 128, 4 pieces of 32 columns, each in 2 row blocks on one host:
    cols  0..31   32..63   64..95   96..127
         +------+ +------+ +------+ +------+
         | r0   | | r2   | | r4   | | r6   |   rows [0, n/2)
         | r1   | | r3   | | r5   | | r7   |   rows [n/2, n)
         +------+ +------+ +------+ +------+
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_shardrec.planner.costs.perf import Workload, holder_output_seconds
from lightning_shardrec.planner.plans.types import ShardingType
from lightning_shardrec.planner.search.enumerate import GridPiece, TableOptions
from lightning_shardrec.planner.search.fill import Piece, Placement, RankLoads, Strip, fill_host_rows


def fill_grid(
    opt: TableOptions,
    work: Workload,
    ranks: RankLoads,
    limit: float,
    cands: Sequence[int] | None,
    level: bool,
) -> Placement | None:
    """The cheapest grid cut of ``opt``'s table that fits under ``limit`` (None: none fits).

    Ties go to the earlier cut of ``opt.grid_cuts``. Cuts are tried by their least possible total (every
    piece in one block on one holder: :func:`_least_total`), and one whose least is above the best total
    found is skipped: it could not win. Narrow cuts have many pieces (each takes the ids again), so once a
    wide cut fits, most narrow ones are never placed.
    """
    best: tuple[float, int, Placement] | None = None
    order = sorted(range(len(opt.grid_cuts)), key=lambda i: (_least_total(opt, work, opt.grid_cuts[i]), i))
    for i in order:
        cut = opt.grid_cuts[i]
        if best is not None and _least_total(opt, work, cut) > best[0]:
            break
        placed = _place_cut(opt, work, cut, ranks, limit, cands, level)
        if placed is not None and (best is None or (placed.total_cost, i) < best[:2]):
            best = (placed.total_cost, i, placed)
    return None if best is None else best[2]


def _least_total(opt: TableOptions, work: Workload, cut: tuple[GridPiece, ...]) -> float:
    """A lower bound of what ``cut`` costs in total: each piece as one block of every row on one holder
    (more blocks pay each block's fixed cost again; more holders pay the exchange inside the host, which
    outweighs the sums they keep)."""
    rows = opt.table.rows
    return sum(gp.cost.at(rows) + holder_output_seconds(opt.table, work, gp.width, 1, 0, 0) for gp in cut)


def _place_cut(
    opt: TableOptions,
    work: Workload,
    cut: tuple[GridPiece, ...],
    ranks: RankLoads,
    limit: float,
    cands: Sequence[int] | None,
    level: bool,
) -> Placement | None:
    """Place the pieces in turn, each charged to ``ranks`` before the next; then undo the charges."""
    pieces: list[Piece] = []
    charges: list[tuple[int, float]] = []
    saved: dict[int, tuple[float, float]] = {}
    try:
        for gp in cut:
            part = Strip(
                kind=ShardingType.GRID_SHARD,
                by_cols=False,
                col0=gp.col0,
                width=gp.width,
                cost=gp.cost,
                mem=gp.mem,
            )
            placed = fill_host_rows(opt, work, part, ranks, limit, cands, level)
            if placed is None:
                return None
            touched = [p.rank for p in placed.pieces] + [r for r, _ in placed.charges]
            saved.update({r: v for r, v in ranks.snapshot(touched).items() if r not in saved})
            placed.charge(ranks)
            pieces.extend(placed.pieces)
            charges.extend(placed.charges)
        return Placement(table=opt.table, kind=ShardingType.GRID_SHARD, pieces=tuple(pieces), charges=tuple(charges))
    finally:
        ranks.restore(saved)
