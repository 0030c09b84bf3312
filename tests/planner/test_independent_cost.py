"""The planner's Criteo-1TB plan under the independent cost model of ``benchmarks/plan_cost.py`` (issue 41).

``plan_cost`` shares no code with the planner: it counts a plan's HBM bytes and the bytes each collective
moves between two ranks (NVLink on a host, NIC across hosts). These tests check that model on plans small
enough to work out by hand, then that the planner stays within 1.10x of its lower bound at 64 GPUs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lightning_shardrec.planner import ParameterSharding, ShardingPlan, ShardMetadata

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


plan_cost = _load("plan_cost")
B, F32 = 1000, 4


def _plan(kind: str, shards: list[tuple[int, int, int, int, int]]) -> ShardingPlan:
    """One table ``t``: shards ``(row0, col0, rows, cols, rank)``."""
    meta = [ShardMetadata((r0, c0), (n, c), rank) for r0, c0, n, c, rank in shards]
    return ShardingPlan({"m": {"t": ParameterSharding(kind, "fused", [m.rank for m in meta], meta)}})


def test_table_wise_on_two_hosts_by_hand() -> None:
    """W = 4, 2 per host, table of 64 columns whole on rank 0: rank 0 looks up every id and sends each
    source its [B, 64] (one over NVLink, two over the NIC), receives the ids and gradients the same way."""
    c = plan_cost.Cluster(world=4, local=2, hbm_bw=1e12, nvlink_bw=1e11, nic_bw=1e10)
    t = plan_cost.Table(rows=100, dim=64, state=1)
    ev = plan_cost.evaluate(_plan("table_wise", [(0, 0, 100, 64, 0)]), {"t": t}, c, B)
    hbm = 4 * B * F32 * (64 * 4 + 2) / 1e12
    out = B * 64 * F32
    ids = B * 8
    link = 2 * (out / 1e11 + 2 * out / 1e10) + ids / 1e11 + 2 * ids / 1e10
    assert ev.per_rank[0] == pytest.approx(hbm + link, rel=1e-12)
    # rank 3 (other host) receives rank 0's output and sends its gradient and ids: over the NIC only
    assert ev.per_rank[3] == pytest.approx((2 * out + ids) / 1e10, rel=1e-12)


def test_grid_holders_pay_their_chunk_and_the_exchange() -> None:
    """W = 4, 2 per host, a 64-column piece row-blocked on ranks 2 and 3 (host 1): holder 0 (rank 2)
    sends sources 0, 1 (host 0, NIC) their sums, holder 1 (rank 3) sources 2 (NVLink) and 3 (itself);
    each sends the other the other's chunk of its partial ([2B, 64]) over NVLink, and back."""
    c = plan_cost.Cluster(world=4, local=2, hbm_bw=1e30, nvlink_bw=1e11, nic_bw=1e10)
    t = plan_cost.Table(rows=100, dim=64, state=1)
    ev = plan_cost.evaluate(_plan("grid_shard", [(0, 0, 50, 64, 2), (50, 0, 50, 64, 3)]), {"t": t}, c, B)
    out, ids = B * 64 * F32, B * 8 / 2
    exchange = 2 * 2 * out / 1e11
    # rank 2: sums out to 2 NIC sources (and their gradients back), its own sums in from rank 3 over
    # NVLink (and back), the ids of half the rows from 2 NIC sources and 1 NVLink source (rank 3)
    nic = 2 * 2 * out / 1e10 + 2 * ids / 1e10
    assert ev.per_rank[2] == pytest.approx(exchange + nic + 2 * out / 1e11 + ids / 1e11, rel=1e-12)
    assert ev.per_rank[3] == pytest.approx(exchange + 2 * out / 1e11 + 2 * ids / 1e10 + ids / 1e11, rel=1e-12)


def test_lower_bound_is_each_tables_cheapest_total_over_the_world() -> None:
    c = plan_cost.Cluster(world=16, local=8)
    big, small = plan_cost.Table(rows=10**7, dim=128), plan_cost.Table(rows=10, dim=128)
    sharded = plan_cost._sharded_total(big, c, B)
    replicated = 16 * sum(plan_cost._dp(small, c, B))
    assert replicated < plan_cost._sharded_total(small, c, B)
    assert plan_cost.lower_bound({"a": big, "b": small}, c, B) == pytest.approx((sharded + replicated) / 16)


def test_criteo_plan_at_64_gpus_within_1_10_of_the_bound() -> None:
    """26 Criteo-1TB tables x 128 columns, 16384 per rank, 8 GPUs per host (the planner's plan: 1.093
    when written, 1.066 since the planner tries the 12th table sharded; 1.32 while column pieces were at least
    32 wide and holders were charged an even split)."""
    check = _load("planner_check")
    plan, _ = check.plan_criteo(64, 16384)
    ev = plan_cost.evaluate(plan, check.criteo_costs(), plan_cost.Cluster(world=64, local=8), 16384)
    assert ev.ratio <= 1.10, f"max rank {ev.max * 1e3:.3f} ms, bound {ev.bound * 1e3:.3f} ms"


def test_narrow_pieces_only_from_32_ranks() -> None:
    from lightning_shardrec.planner.plans.tables import default_min_partition

    assert [default_min_partition(w) for w in (1, 2, 16, 31, 32, 64, 1024)] == [32, 32, 32, 32, 8, 8, 8]
