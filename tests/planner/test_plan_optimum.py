"""The optimum of the independent cost model over whole-row plans (``benchmarks/plan_optimum.py``, issue 41).

``plan_cost.lower_bound`` is loose for Criteo-1TB at 128 GPUs: 1,408 sharded columns are 11 per rank, but
column shards are multiples of 4 wide and each receives every source's ids. ``plan_optimum`` finds the
least slowest rank any plan of replicated tables and whole-row column shards can have. These tests check
it against every such plan of small worlds, then hold the planner's 64- and 128-GPU plans within 1.02x of it.
``any_plan_bound`` bounds every plan, row-blocked pieces included: checked below random plans of every sharding
type, it holds the 64- and 128-GPU plans within 1.10x of the optimum over all plans.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from lightning_shardrec.planner import ParameterSharding, ShardingPlan, ShardMetadata

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
Choice = tuple[tuple[int, ...], tuple[int, ...]] | None  # (widths, ranks) or None: replicated


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


plan_cost = _load("plan_cost")
plan_optimum = _load("plan_optimum")


def _compositions(total: int, step: int) -> Iterator[tuple[int, ...]]:
    if total == 0:
        yield ()
        return
    for first in range(step, total + 1, step):
        for rest in _compositions(total - first, step):
            yield (first, *rest)


def _choices(dim: int, world: int) -> Iterator[Choice]:
    yield None
    for widths in _compositions(dim, 4):
        for ranks in itertools.product(range(world), repeat=len(widths)):
            yield widths, ranks


def _plan(choice: dict[str, Choice], tables: dict) -> ShardingPlan:
    per_table = {}
    for name, ch in choice.items():
        if ch is None:
            per_table[name] = ParameterSharding("data_parallel", "dense", None, None)
            continue
        widths, ranks = ch
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        spans = zip(offsets, widths, ranks, strict=True)
        metas = [ShardMetadata((0, o), (tables[name].rows, w), r) for o, w, r in spans]
        per_table[name] = ParameterSharding("column_wise", "fused", list(ranks), metas)
    return ShardingPlan({"m": per_table})


@pytest.mark.parametrize(
    ("world", "local", "dim", "rows"),
    [
        (4, 2, 8, (50, 5000)),  # both sharded, one 4-column shard per rank
        (4, 1, 8, (500, 100)),  # all replicated
        (8, 4, 8, (3000, 40)),
        (3, 1, 12, (20_000, 90_000)),  # 24 columns on 3 ranks: 8 + 4 per table, one rank holds two shards
        (2, 2, 12, (7, 80_000)),
    ],
)
def test_family_optimum_is_the_best_whole_row_plan(world: int, local: int, dim: int, rows: tuple[int, ...]) -> None:
    """Every plan of replicated tables and 4-aligned whole-row column shards, evaluated: the least slowest
    rank equals ``family_optimum`` (a lower bound over them all, reached by one)."""
    c = plan_cost.Cluster(world=world, local=local, hbm_bw=1e12, nvlink_bw=1e11, nic_bw=1e10)
    tables = {f"t{i}": plan_cost.Table(rows=n, dim=dim) for i, n in enumerate(rows)}
    per_table = [list(_choices(dim, world)) for _ in tables]
    best = min(
        plan_cost.evaluate(_plan(dict(zip(tables, combo, strict=True)), tables), tables, c, 1000).max
        for combo in itertools.product(*per_table)
    )
    assert plan_optimum.family_optimum(tables, c, 1000).value == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize(("world", "sharded", "widest", "shards"), [(64, 12, 24, 2), (128, 11, 12, 1)])
def test_criteo_plan_within_1_02_of_the_optimum(world: int, sharded: int, widest: int, shards: int) -> None:
    """26 Criteo-1TB tables x 128 columns, 16384 per rank, 8 GPUs per host. At 128 GPUs the optimum over
    whole-row plans shards the 11 largest tables, its dearest rank 12 columns in one shard (5.507 ms, 1.129x the
    average bound); at 64 it shards 12, the dearest rank 24 columns in two shards (4.967 ms, 1.066x). The
    planner's plans are those optima (ratio 1.000 when written; at 64 it was 1.025 while the 12th table, 12,973
    rows, stayed replicated: ``enumerate.next_to_shard``)."""
    check = _load("planner_check")
    costs, cluster = check.criteo_costs(), plan_cost.Cluster(world=world, local=8)
    plan, _ = check.plan_criteo(world, 16384)
    ev = plan_cost.evaluate(plan, costs, cluster, 16384)
    opt = plan_optimum.family_optimum(costs, cluster, 16384)
    assert (len(opt.sharded), opt.widest, opt.shards) == (sharded, widest, shards)
    assert opt.value > 1.06 * ev.bound  # the average bound is out of reach of every whole-row plan
    assert ev.max <= 1.02 * opt.value, f"max rank {ev.max * 1e3:.3f} ms, optimum {opt.value * 1e3:.3f} ms"


def test_family_optimum_names_what_it_cannot_solve() -> None:
    c = plan_cost.Cluster(world=4, local=2)
    mixed = {"a": plan_cost.Table(rows=10, dim=8), "b": plan_cost.Table(rows=10, dim=16)}
    with pytest.raises(ValueError, match=r"needs one \(dim, pooling, state\) for all tables; got \[\(8, "):
        plan_optimum.family_optimum(mixed, c, 100)
    with pytest.raises(ValueError, match="dim 6 is not a multiple of the column alignment 4"):
        plan_optimum.family_optimum({"a": plan_cost.Table(rows=10, dim=6)}, c, 100)


def _random_plan(rng: random.Random, tables: dict, world: int, local: int) -> ShardingPlan:
    """A plan of any sharding type per table: 4-aligned widths, a piece's row blocks on distinct ranks of one host."""

    def rows_split(rows: int, k: int) -> list[tuple[int, int]]:
        cuts = sorted(rng.sample(range(1, rows), k - 1)) if k > 1 else []
        edges = [0, *cuts, rows]
        return [(a, b - a) for a, b in itertools.pairwise(edges)]

    def piece(name: str, col: int, width: int) -> list[ShardMetadata]:
        host = rng.randrange(world // local)
        ranks = rng.sample(range(host * local, (host + 1) * local), rng.randint(1, min(local, tables[name].rows)))
        blocks = rows_split(tables[name].rows, len(ranks))
        return [ShardMetadata((o, col), (n, width), r) for (o, n), r in zip(blocks, ranks, strict=True)]

    per_table = {}
    for name, t in tables.items():
        kind = rng.choice(["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "grid_shard"])
        if kind == "data_parallel":
            per_table[name] = ParameterSharding(kind, "dense", None, None)
            continue
        if kind == "table_wise":
            metas = [ShardMetadata((0, 0), (t.rows, t.dim), rng.randrange(world))]
        elif kind == "column_wise":
            widths = rng.choice(list(_compositions(t.dim, 4)))
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            metas = [
                ShardMetadata((0, o), (t.rows, w), rng.randrange(world)) for o, w in zip(offsets, widths, strict=True)
            ]
        elif kind == "row_wise":
            ranks = rng.sample(range(world), rng.randint(1, min(world, t.rows)))
            blocks = rows_split(t.rows, len(ranks))
            metas = [ShardMetadata((o, 0), (n, t.dim), r) for (o, n), r in zip(blocks, ranks, strict=True)]
        elif kind == "table_row_wise":
            metas = piece(name, 0, t.dim)
        else:
            widths = rng.choice(list(_compositions(t.dim, 4)))
            metas = [m for i, w in enumerate(widths) for m in piece(name, sum(widths[:i]), w)]
        per_table[name] = ParameterSharding(kind, "fused", sorted({m.rank for m in metas}), metas)
    return ShardingPlan({"m": per_table})


@pytest.mark.parametrize(
    ("world", "local", "dim", "rows", "bw"),
    [
        (8, 4, 8, (3000, 40, 900), (1e12, 1e11, 1e10)),
        (16, 4, 12, (20_000, 90_000, 5), (1e12, 1e11, 1e10)),
        (16, 8, 8, (50_000, 70_000, 300, 8_000), (2e12, 4.5e11, 5e10)),
        (4, 2, 16, (7, 80_000), (1e12, 1e11, 1e10)),
    ],
)
def test_any_plan_bound_holds_for_plans_of_every_sharding_type(
    world: int, local: int, dim: int, rows: tuple[int, ...], bw: tuple[float, float, float]
) -> None:
    """``any_plan_bound`` is below the slowest rank of 300 random plans (row-blocked pieces, row_wise, column
    and table shards, replicated tables, mixed), of the best whole-row plan, and not below ``plan_cost``'s bound."""
    c = plan_cost.Cluster(world=world, local=local, hbm_bw=bw[0], nvlink_bw=bw[1], nic_bw=bw[2])
    tables = {f"t{i}": plan_cost.Table(rows=n, dim=dim) for i, n in enumerate(rows)}
    bound = plan_optimum.any_plan_bound(tables, c, 1000)
    rng = random.Random(world * 1000 + dim)
    slowest = min(plan_cost.evaluate(_random_plan(rng, tables, world, local), tables, c, 1000).max for _ in range(300))
    assert bound.value <= slowest * (1 + 1e-9)
    assert bound.value <= plan_optimum.family_optimum(tables, c, 1000).value * (1 + 1e-9)
    assert bound.value >= plan_cost.lower_bound(tables, c, 1000) * (1 - 1e-9)


@functools.cache
def _criteo_bound(world: int) -> float:
    check = _load("planner_check")
    return plan_optimum.any_plan_bound(check.criteo_costs(), plan_cost.Cluster(world=world, local=8), 16384).value


@pytest.mark.parametrize("world", [64, 128])
@pytest.mark.parametrize("kind", ["table_row_wise", "grid_shard", "row_wise"])
def test_criteo_plans_of_row_blocked_pieces_stay_above_the_bound(world: int, kind: str) -> None:
    """The planner's Criteo plans with every table forced row-blocked (TorchRec's choice at these sizes is
    table_row_wise) cost more than the every-plan bound, as every plan must."""
    from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    check = _load("planner_check")
    costs = check.criteo_costs()
    constraints = {name: ParameterConstraints(sharding_types=[kind]) for name in costs}
    topology = Topology(world, compute_device="cuda", local_world_size=8)
    plan = EmbeddingShardingPlanner(topology, batch_size=16384, constraints=constraints).plan(check.criteo_tables())
    assert {ps.sharding_type.value for t in plan.plan.values() for ps in t.values()} == {kind}
    slowest = plan_cost.evaluate(plan, costs, plan_cost.Cluster(world=world, local=8), 16384).max
    assert slowest >= _criteo_bound(world)


@pytest.mark.parametrize(("world", "within"), [(64, 1.04), (128, 1.07)])
def test_criteo_plan_within_1_10_of_the_bound_over_every_plan(world: int, within: float) -> None:
    """The planner's 64- and 128-GPU Criteo plans are within 1.10x of the least slowest rank ANY plan can have
    (row-blocked pieces included): 1.035x and 1.068x when written. ``plan_cost``'s average bound (1.066x,
    1.129x) is out of reach of every whole-row plan at 128 GPUs; this one is not."""
    check = _load("planner_check")
    costs, cluster = check.criteo_costs(), plan_cost.Cluster(world=world, local=8)
    plan, _ = check.plan_criteo(world, 16384)
    ev = plan_cost.evaluate(plan, costs, cluster, 16384)
    bound = _criteo_bound(world)
    assert ev.bound < bound <= ev.max
    assert ev.max <= within * bound, f"max rank {ev.max * 1e3:.3f} ms, bound {bound * 1e3:.3f} ms"
