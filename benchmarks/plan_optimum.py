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
        print(
            f"W={w}: optimum {opt.value * 1e3:.3f} ms ({len(opt.sharded)} tables sharded, dearest rank "
            f"{opt.widest} columns in {opt.shards} shards; average bound {opt.average * 1e3:.3f})"
        )


if __name__ == "__main__":
    main()
