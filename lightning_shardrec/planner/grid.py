"""Grid cuts: a table cut into column pieces, each piece row-blocked over ranks of one host.

The 2-D cut TorchRec calls ``grid_shard``. Each piece is placed like a table_row_wise
table (:func:`~lightning_shardrec.planner.fill.fill_host_rows`), after the pieces before
it, so the pieces of one table spread over the emptiest ranks; different pieces may
land on different hosts. Every column cut of :func:`~lightning_shardrec.planner.enumerate.column_cuts`
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

from lightning_shardrec.planner.enumerate import GridPiece, TableOptions
from lightning_shardrec.planner.fill import Piece, Placement, RankLoads, Strip, fill_host_rows
from lightning_shardrec.planner.perf import Workload
from lightning_shardrec.planner.types import ShardingType


def fill_grid(
    opt: TableOptions,
    work: Workload,
    ranks: RankLoads,
    limit: float,
    cands: Sequence[int] | None,
    level: bool,
) -> Placement | None:
    """The cheapest grid cut of ``opt``'s table that fits under ``limit`` (None: none fits)."""
    best: Placement | None = None
    for cut in opt.grid_cuts:
        placed = _place_cut(opt, work, cut, ranks, limit, cands, level)
        if placed is not None and (best is None or placed.total_cost < best.total_cost):
            best = placed
    return best


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
