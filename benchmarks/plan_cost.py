"""An independent cost model of a sharding plan: HBM, NVLink and NIC bytes per rank (issue 41).

Shares no code with ``lightning_shardrec/planner`` (it reads only the plan's shards), so it can
check the planner's own estimates. Per rank ``r`` of ``W`` (``L`` per host, ``B`` samples each,
a table of ``D`` columns with ``P`` ids per sample, fp32 everywhere, ids int64):

* **HBM**: every id a shard looks up reads its ``c`` columns, and backward reads the gradient,
  reads and writes the row and its optimizer state (``S`` floats per row):
  ``ids * 4 * (c + c + 2c + 2S(c))`` bytes over ``hbm_bw``. A data-parallel table looks up its
  ``B * P`` local ids (and writes ``[B, D]``), and updates the whole table densely (gradient,
  weights and state read and written).
* **Links**: the bytes each collective moves between two ranks. A rank's time in one collective is
  ``max(sent, received)`` over NVLink to ranks of its host plus ``max(sent, received)`` over its NIC
  to other hosts (full-duplex links). Collectives: the ids (each source sends the ids of a shard's
  rows to its owner, once per shard), the pooled output forward and its gradient backward (the
  reverse), and for row-blocked pieces the exchange among the piece's holders:

  - table_wise / column_wise: the owner sends ``[B, c]`` to every source.
  - row_wise: the owner's partial ``[B * W, D]`` is reduce-scattered: ``[B, D]`` to every source.
  - table_row_wise / grid_shard: a piece's ``k`` holders on one host; each sends every other holder
    the rows of that holder's chunk of sources (``[B * W / k, c]``), then each sends every source
    of its chunk (source ``s`` to holder ``s * k // W``) its ``[B, c]`` sums.
  - data_parallel: a ring all-reduce of the table's gradient, ``2 (W-1)/W`` of it over the NIC
    (over NVLink on one host).

**Lower bound** (plan-free): per table, the least total over all ranks any arrangement costs, divided
by ``W``. Sharded, whatever the cut: the lookups' HBM bytes are the same in total; every source must
receive ``[B, D]`` except what it holds, and whatever the placement that is ``(L-1) B D 4`` bytes over
NVLink and ``(W-L) B D 4`` over NICs in total (forward, and again backward); ids likewise ``(L-1) B P 8``
and ``(W-L) B P 8`` at least. Replicated: ``W`` times a rank's lookup, update and all-reduce.
A rank's time is at least what it receives, so the sum over ranks is at least these totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

F32 = 4
ID = 8
PHASES = ("ids", "out_fwd", "out_bwd", "hold_fwd", "hold_bwd")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``world`` ranks, ``local`` per host; bandwidths in bytes/s (H100-class defaults)."""

    world: int
    local: int
    hbm_bw: float = 2.0e12
    nvlink_bw: float = 4.5e11
    nic_bw: float = 5.0e10

    @property
    def hosts(self) -> int:
        return self.world // self.local


@dataclass(frozen=True, kw_only=True)
class Table:
    rows: int
    dim: int
    pooling: float = 1.0  # ids per sample (one bag per sample)
    state: int = -1  # optimizer floats per row; -1: dim (adagrad)

    def state_of(self, cols: int) -> int:
        return cols if self.state < 0 else self.state


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    per_rank: np.ndarray  # seconds per rank
    hbm: np.ndarray
    links: np.ndarray
    allreduce: np.ndarray
    bound: float

    @property
    def max(self) -> float:
        return float(self.per_rank.max())

    @property
    def ratio(self) -> float:
        return self.max / self.bound


def _hbm_bytes(ids: float, cols: int, t: Table) -> float:
    return ids * F32 * (cols + cols + 2 * cols + 2 * t.state_of(cols))


def _dp(t: Table, c: Cluster, batch: int) -> tuple[float, float]:
    """A replicated table's HBM seconds and all-reduce seconds per rank."""
    ids = batch * t.pooling
    hbm = (ids * t.dim * F32 * 2 + t.rows * F32 * (t.dim + 2 * t.dim + 2 * t.state_of(t.dim))) / c.hbm_bw
    grad = t.rows * t.dim * F32
    bw = c.nic_bw if c.hosts > 1 else c.nvlink_bw
    return hbm, 0.0 if c.world == 1 else 2 * (c.world - 1) / c.world * grad / bw


def _sharded_total(t: Table, c: Cluster, batch: int) -> float:
    w, loc = c.world, c.local
    hbm = _hbm_bytes(batch * w * t.pooling, t.dim, t) / c.hbm_bw
    out = 2 * batch * t.dim * F32 * ((loc - 1) / c.nvlink_bw + (w - loc) / c.nic_bw)
    ids = batch * t.pooling * ID * ((loc - 1) / c.nvlink_bw + (w - loc) / c.nic_bw)
    return hbm + out + ids


def lower_bound(tables: Mapping[str, Table], c: Cluster, batch: int, dp_allowed: bool = True) -> float:
    total = 0.0
    for t in tables.values():
        best = _sharded_total(t, c, batch)
        if dp_allowed:
            best = min(best, c.world * sum(_dp(t, c, batch)))
        total += best
    return total / c.world


def evaluate(plan: object, tables: Mapping[str, Table], c: Cluster, batch: int, dp_allowed: bool = True) -> Evaluation:
    """``plan``: a ``ShardingPlan`` (``plan.plan[path][name]`` with ``sharding_type`` and ``shards``)."""
    w = c.world
    mats = {p: np.zeros((w, w)) for p in PHASES}
    hbm = np.zeros(w)
    allreduce = np.zeros(w)
    for per_module in plan.plan.values():  # type: ignore[attr-defined]
        for name, ps in per_module.items():
            t = tables[name]
            kind = ps.sharding_type.value
            if kind == "data_parallel":
                h, a = _dp(t, c, batch)
                hbm += h
                allreduce += a
                continue
            pieces: dict[tuple[int, int, int], list[int]] = {}
            for s in ps.shards:
                rows, cols = s.shard_sizes
                frac = rows / t.rows
                ids = batch * t.pooling * frac
                hbm[s.rank] += _hbm_bytes(ids * w, cols, t) / c.hbm_bw
                mats["ids"][:, s.rank] += ids * ID
                if kind in ("table_wise", "column_wise"):
                    mats["out_fwd"][s.rank, :] += batch * cols * F32
                elif kind == "row_wise":
                    mats["out_fwd"][s.rank, :] += batch * t.dim * F32
                else:
                    key = (s.rank // c.local, s.shard_offsets[1], cols)
                    pieces.setdefault(key, []).append(s.rank)
            for (_, _, cols), holders in pieces.items():
                holders = sorted(holders)
                k = len(holders)
                for i, hi in enumerate(holders):
                    chunk = [s for s in range(w) if s * k // w == i]
                    mats["out_fwd"][hi, chunk] += batch * cols * F32
                    for hj in holders:
                        if hj != hi:
                            mats["hold_fwd"][hi, hj] += len(chunk) * batch * cols * F32
    mats["out_bwd"] = mats["out_fwd"].T.copy()
    mats["hold_bwd"] = mats["hold_fwd"].T.copy()
    host = np.arange(w) // c.local
    same = host[:, None] == host[None, :]
    np.fill_diagonal(same, False)
    other = host[:, None] != host[None, :]
    links = np.zeros(w)
    for m in mats.values():
        intra = np.maximum((m * same).sum(1), (m * same).sum(0))
        inter = np.maximum((m * other).sum(1), (m * other).sum(0))
        links += intra / c.nvlink_bw + inter / c.nic_bw
    per_rank = hbm + links + allreduce
    return Evaluation(
        per_rank=per_rank, hbm=hbm, links=links, allreduce=allreduce, bound=lower_bound(tables, c, batch, dp_allowed)
    )
