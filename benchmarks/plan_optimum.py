"""The optimum of ``plan_cost`` over plans of whole-row column shards and replicated tables (issue 41).

``plan_cost.lower_bound`` divides each table's least total work by the world size, as if work were
divisible to the column. It is not: a column shard is a multiple of 4 columns wide (fbgemm's row
alignment, ``planner/plans/tables.py: COLUMN_ALIGN``), and each shard receives every source's ids.
This module finds the exact optimum of the same independent model over the family of plans whose
every table is either replicated (data_parallel) or cut into column shards of whole rows
(table_wise, column_wise), any widths that are multiples of ``align``, on any ranks. Row-blocked
pieces (row_wise, table_row_wise, grid_shard) are outside the family; the planner's 64- and 128-GPU plans
for Criteo-1TB are inside it.

**Lower bound.** Let ``S`` be the sharded tables (the rest replicated). Every rank pays each replicated
table's lookup, dense update and all-reduce (``plan_cost._dp``): ``F(S)``. A rank holding ``s`` shards of
``k`` columns in all sends ``[B, k]`` to every other rank and receives the gradient (a phase's time is at
least what it sends, or receives, over each link), receives every source's ids once per shard, and looks
up ``B * W`` ids in ``k`` columns: ``rank_cost(k, s)``. For a budget ``T``, let ``widest[s]`` be the most
columns (a multiple of ``align``) a rank of ``s`` shards can hold at ``rank_cost <= T - F(S)``. If every rank
keeps to the budget, no shard is wider than ``widest[1]``, so each table needs ``ceil(D / widest[1])``
shards, and the ranks must hold all ``sum(D_t, t in S)`` columns: ``_fits`` checks both (ranks of one
shard hold the most columns; the shards missing come from ranks of several, at the least loss of columns,
a small knapsack). The least ``T`` that passes (a binary search over every ``(k, s)`` a rank may hold)
bounds the slowest rank from below, and so does the average (``plan_cost``'s bound for this ``S``). With
equal dims and pooling (the Criteo case) both terms fall as the tables dearest to replicate join ``S``,
so each size of ``S`` needs only its largest tables; the optimum over the family is at least the least,
over the sizes, of the larger of the two. **Attained**: where a plan of the family reaches it, that is the
optimum; the planner's 64- and 128-GPU plans do (``planner_check.py`` prints both), and
``tests/planner/test_plan_optimum.py`` checks it against every plan of the family in small worlds.

**Every plan** (``any_plan_bound``): row-blocked pieces (row_wise, table_row_wise, grid_shard) split a
piece's output among its holders, so the family's optimum does not bound them. ``any_plan_bound`` does:
a rank's time is at least the sum of its holdings' terms, the coverage and the two couplings inside a piece
(its holders' row fractions sum to 1, their chunks of sources hold the host's ranks once) are relaxed with
Lagrange multipliers, and each rank is then a small linear programme (the docstrings have the argument).
It assumes what every plan of the planner has: shards 4-aligned in width, a piece's row blocks on distinct
ranks of one host. The test checks it against random plans of every sharding type.

    python benchmarks/plan_optimum.py [--worlds 64,128,512,1024]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from plan_cost import F32, ID, Cluster, Table, _dp, _hbm_bytes, _sharded_total

COLUMN_ALIGN = 4


@dataclass(frozen=True, kw_only=True)
class FamilyOptimum:
    """The least slowest-rank time (seconds) any whole-row plan can have, and the choice that gives it."""

    value: float
    sharded: tuple[str, ...]  # the tables the optimum shards (the rest replicated)
    widest: int  # columns of the fullest rank at the optimum
    shards: int  # shards of the dearest rank at the optimum
    average: float  # plan_cost's average bound for that choice


def rank_cost(cols: Any, shards: Any, t: Table, c: Cluster, batch: int) -> Any:
    """What a rank holding ``shards`` whole-row shards of ``cols`` columns in all pays at least (numbers or arrays)."""
    w, loc = c.world, c.local
    links = (w - loc) / c.nic_bw + (loc - 1) / c.nvlink_bw
    out = 2 * batch * cols * F32 * links  # sends [B, cols] forward, receives its gradient backward
    ids = shards * batch * t.pooling * ID * links  # receives every source's ids for each shard
    hbm = _hbm_bytes(batch * t.pooling * w, cols, t) / c.hbm_bw
    return out + ids + hbm


def _fits(budget: float, m: int, dim: int, t: Table, c: Cluster, batch: int, align: int) -> bool:
    """Can ``c.world`` ranks, none dearer than ``budget``, hold ``m`` tables of ``dim`` columns?

    Necessary conditions only (so a ``False`` is a proof): with ``widest[s]`` the most columns a rank of
    ``s`` shards can hold within the budget, every table needs ``ceil(dim / widest[1])`` shards at least
    (no shard is wider), and the ranks must hold ``m * dim`` columns. Ranks of one shard hold the most
    columns; each rank turned into one of ``s`` shards adds ``s - 1`` shards and loses
    ``widest[1] - widest[s]`` columns; the least loss for the shards missing is a small knapsack.
    """
    widest: dict[int, int] = {}
    for s in range(1, m * dim // align + 1):  # costs grow with the shards: stop at the first count that fits nowhere
        ks = np.arange(s * align, dim * m + 1, align)
        fit = ks[rank_cost(ks, s, t, c, batch) <= budget * (1 + 1e-12)]  # (rounding counts for the ranks)
        if not fit.size:
            break
        widest[s] = int(fit.max())
    if 1 not in widest:
        return m == 0
    missing = m * math.ceil(dim / widest[1]) - c.world
    loss = [0.0] + [math.inf] * max(missing, 0)
    for need in range(1, max(missing, 0) + 1):
        for s, cols in widest.items():
            if s > 1:
                loss[need] = min(loss[need], loss[max(need - (s - 1), 0)] + widest[1] - cols)
    if missing > 0 and not math.isfinite(loss[missing]):
        return False
    return c.world * widest[1] - (loss[missing] if missing > 0 else 0) >= m * dim


def family_optimum(tables: Mapping[str, Table], c: Cluster, batch: int, align: int = COLUMN_ALIGN) -> FamilyOptimum:
    """The least slowest rank over whole-row plans (a lower bound; the plan that reaches it proves it)."""
    shapes = {(t.dim, t.pooling, t.state) for t in tables.values()}
    if len(shapes) != 1:
        raise ValueError(f"family_optimum needs one (dim, pooling, state) for all tables; got {sorted(shapes)}")
    dim = next(iter(shapes))[0]
    if dim % align:
        raise ValueError(f"dim {dim} is not a multiple of the column alignment {align}")
    per_rank_dp = {n: sum(_dp(t, c, batch)) for n, t in tables.items()}
    order = sorted(tables, key=lambda n: -per_rank_dp[n])  # dearest to replicate first
    t = tables[order[0]]
    best = FamilyOptimum(value=math.inf, sharded=(), widest=0, shards=0, average=math.inf)
    for m in range(len(order) + 1):
        sharded, replicated = order[:m], order[m:]
        fixed = sum(per_rank_dp[n] for n in replicated)
        average = fixed + sum(_sharded_total(tables[n], c, batch) for n in sharded) / c.world
        if m == 0:
            candidates = [(fixed, 0, 0)]
        else:
            # every (columns, shards) a rank may hold; the slowest rank costs one of these
            ss = np.concatenate([np.full(m * dim // align - s + 1, s) for s in range(1, m * dim // align + 1)])
            ks = np.concatenate([np.arange(s * align, m * dim + 1, align) for s in range(1, m * dim // align + 1)])
            values = fixed + rank_cost(ks, ss, t, c, batch)
            order_ = np.argsort(values, kind="stable")
            lo, hi = 0, len(order_) - 1  # the whole world's columns on one rank of one shard always fit
            while lo < hi:
                mid = (lo + hi) // 2
                if _fits(float(values[order_[mid]]) - fixed, m, dim, t, c, batch, align):
                    hi = mid
                else:
                    lo = mid + 1
            at = order_[lo]
            candidates = [(float(values[at]), int(ks[at]), int(ss[at]))]
        value, widest, shards = candidates[0]
        value = max(value, average)
        if value < best.value:
            best = FamilyOptimum(value=value, sharded=tuple(sharded), widest=widest, shards=shards, average=average)
    return best


@dataclass(frozen=True, kw_only=True)
class AnyPlanBound:
    """A lower bound on the slowest rank of every plan of ``plan_cost`` (row-blocked pieces included)."""

    value: float
    sharded: int  # how many tables the bound's choice shards
    theta: float  # the multipliers that gave it
    nu: float


def _piece_kinds(t: Table, c: Cluster, batch: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """What a rank pays for what it holds: lower bounds of ``plan_cost.evaluate``'s terms (seconds).

    Returns ``(rates, place, cw_col, (beta, h1))``. A holder of a piece of ``k`` holders (all on one host) sends the
    pooled sums of its chunk of ``n = floor(W / k)`` sources, ``x`` of them on its host (itself among them when
    ``x > 0``), and its chunk's rows to the ``k - 1`` other holders, forward and backward: per column
    ``kinds[i]``, whatever its rows. The piece's chunks hold the host's ``L`` ranks once: ``sum(x) = L``.
    ``place[i] = (k, x)``. A whole-row column shard pays ``cw_col`` per column. A holding of a fraction ``f``
    of the rows pays ``f * (beta + h1 * cols)``: the ids it receives, the rows it reads and writes.
    """
    w, loc = c.world, c.local
    rates, place = [], []
    for k in range(1, loc + 1):
        n = w // k
        for x in sorted({loc} if k == 1 else {0, 1, min(loc, n)}):
            out = (max(x - 1, 0) / c.nvlink_bw + (n - x) / c.nic_bw) * batch * F32
            hold = (k - 1) * n * batch * F32 / c.nvlink_bw
            rates.append(2 * (out + hold))
            place.append((k, x))
    links = (loc - 1) / c.nvlink_bw + (w - loc) / c.nic_bw
    ids = batch * t.pooling * w
    h1 = ids * F32 * (4 + (2 if t.state < 0 else 0)) / c.hbm_bw
    h0 = ids * F32 * 2 * max(t.state, 0) / c.hbm_bw
    beta = batch * t.pooling * ID * links + h0
    return np.array(rates), np.array(place, dtype=float), 2 * batch * F32 * links, (beta, h1)


def _most_value(budget: float, worth: np.ndarray, keep: np.ndarray, kinds: tuple, align: int) -> float:
    """The most one rank within ``budget`` adds to the relaxed coverage (an upper bound).

    Relaxed coverage: ``sum(area) - sum over pieces' holdings of cols * (theta_k * (f - 1/k) + nu * (x - L/k))``,
    which is at least the area in every plan (each piece's ``f`` sum to 1 at most and its ``x`` to ``L``). A
    rank holds ``c1`` columns of whole-row shards (one shard: more only add ids) and ``g`` columns of pieces,
    those of one kind merged into one. A column of kind ``i`` is worth ``worth[i] = theta_k / k + nu * (L/k -
    x)`` without its rows and ``keep[i] = 1 - theta_k`` more with them; the ids a piece receives, ``f * beta``,
    are at least ``beta / g`` per column of rows (no piece is wider than ``g``). That leaves a linear programme
    over the columns of each (kind, with rows or not) summing to ``g`` under one budget: at a vertex at most
    two of them are used, and every pair is tried.
    """
    rates, _, cw_col, (beta, h1) = kinds
    best = 0.0
    c1 = 0
    while True:
        r = budget - (cw_col * c1 + beta + h1 * c1 if c1 else 0.0)
        if r < 0:
            return best
        best = max(best, c1)
        g = np.arange(align, int(r / rates.min()) + align, align, dtype=float)[:, None]
        cost = np.concatenate([np.broadcast_to(rates, (len(g), len(rates))), rates + beta / g + h1], axis=1)
        value = np.broadcast_to(np.concatenate([worth, worth + keep]), cost.shape)
        ia, ib = np.triu_indices(cost.shape[1])
        ca, cb, va, vb = cost[:, ia], cost[:, ib], value[:, ia], value[:, ib]
        # all g columns one item (when it fits), or the budget line between two items
        whole = np.where(ca * g <= r, va * g, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            n = (r - cb * g) / (ca - cb)
        ok = np.isfinite(n) & (n >= 0) & (n <= g)
        with np.errstate(invalid="ignore"):
            mixed = np.where(ok, va * n + vb * (g - n), 0.0)
        best = max(best, c1 + float(max(whole.max(initial=0.0), mixed.max(initial=0.0))))
        c1 += align


def any_plan_bound(
    tables: Mapping[str, Table], c: Cluster, batch: int, align: int = COLUMN_ALIGN, grid: int = 11
) -> AnyPlanBound:
    """A lower bound on the slowest rank over every plan (row_wise, table_row_wise and grid pieces too).

    Each rank's time is at least the sum over what it holds of ``_piece_kinds``'s terms (a phase costs
    ``max(sent, received)``; the bound takes one side per phase, so holdings add). The sharded tables must
    be covered, ``sum(area) = m * dim`` (a holding's area its columns times its fraction of rows ``f``), the
    ``k`` holders of a piece share its rows (``sum(f) <= 1``) and their chunks the host's ranks
    (``sum(x) = L``). Relaxing those two couplings with multipliers (Lagrange: ``theta``, ``nu``, on a grid)
    leaves each rank on its own: a budget ``T`` is out of reach when ``W * _most_value < m * dim`` for some
    multipliers. A row_wise shard sends ``[B, dim]`` to every source; the search stops at that cost (a
    budget there counts as reachable), so the bound stays a bound where it cannot rule row_wise out.
    """
    shapes = {(t.dim, t.pooling, t.state) for t in tables.values()}
    if len(shapes) != 1:
        raise ValueError(f"any_plan_bound needs one (dim, pooling, state) for all tables; got {sorted(shapes)}")
    dim = next(iter(shapes))[0]
    per_rank_dp = {n: sum(_dp(t, c, batch)) for n, t in tables.items()}
    order = sorted(tables, key=lambda n: -per_rank_dp[n])
    kinds = _piece_kinds(tables[order[0]], c, batch)
    rates, place, cw_col, _ = kinds
    k, x = place[:, 0], place[:, 1]
    nu_unit = 2 * batch * F32 * (1 / c.nic_bw - 1 / c.nvlink_bw) / cw_col  # a column's saving per x, in columns
    multipliers = [(th, nu * nu_unit) for th in np.linspace(0, 1, grid) for nu in np.linspace(0, 2, grid)]
    best = AnyPlanBound(value=math.inf, sharded=0, theta=0.0, nu=0.0)
    for m in range(len(order) + 1):
        fixed = sum(per_rank_dp[n] for n in order[m:])
        value = fixed + m * _sharded_total(tables[order[0]], c, batch) / c.world  # plan_cost's average bound
        theta_nu = (0.0, 0.0)
        if value >= best.value:
            continue
        for theta, nu in multipliers if m else ():
            th = np.where(k > 1, theta, 0.0)  # a piece of one holder: sum(f) <= 1 holds anyway
            worth, keep = th / k + nu * (c.local / k - x), 1 - th
            lo, hi = value - fixed, cw_col * dim  # past a row_wise shard's cost the test cannot rule a budget out
            if c.world * _most_value(lo, worth, keep, kinds, align) >= m * dim:
                continue
            while hi - lo > 1e-9 * hi:
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if c.world * _most_value(mid, worth, keep, kinds, align) >= m * dim else (mid, hi)
            if fixed + lo > value:
                value, theta_nu = fixed + lo, (float(theta), float(nu))
        if value < best.value:
            best = AnyPlanBound(value=value, sharded=m, theta=theta_nu[0], nu=theta_nu[1])
    return best


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner_check import criteo_costs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="64,128,512,1024")
    parser.add_argument("--batch-size", type=int, default=16384)
    args = parser.parse_args()
    for w in (int(x) for x in args.worlds.split(",")):
        opt = family_optimum(criteo_costs(), Cluster(world=w, local=8), args.batch_size)
        anyp = any_plan_bound(criteo_costs(), Cluster(world=w, local=8), args.batch_size)
        print(
            f"W={w}: optimum {opt.value * 1e3:.3f} ms ({len(opt.sharded)} tables sharded, dearest rank "
            f"{opt.widest} columns in {opt.shards} shards; average bound {opt.average * 1e3:.3f}); "
            f"every plan, row-blocked too: >= {anyp.value * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
