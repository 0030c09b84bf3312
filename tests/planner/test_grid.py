"""grid_shard in the planner: column cuts, cost (blocks, and the output that table_row_wise
and grid pieces charge each of their holders), validation of given
plans, JSON, the printed table, and the plans it makes."""

from __future__ import annotations

import pytest
from planner_helpers import bag, check_plan

from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    Topology,
    Workload,
    shard_perf,
)
from lightning_shardrec.planner.costs.perf import holder_output_seconds, host_charges
from lightning_shardrec.planner.plans.tables import table_specs
from lightning_shardrec.planner.search.enumerate import column_cuts

ROWS = 1_000_000
GRID = ShardingType.GRID_SHARD


def grid(pieces: list[tuple[int, int, list[tuple[int, int, int]]]]) -> ParameterSharding:
    """``[(col0, width, [(row0, rows, rank), ...]), ...]`` as a grid_shard sharding."""
    shards = [ShardMetadata((r0, c0), (n, w), rank) for c0, w, blocks in pieces for r0, n, rank in blocks]
    return ParameterSharding(GRID, "fused", [s.rank for s in shards], shards)


HALF = ROWS // 2
VALID = grid([(0, 64, [(0, HALF, 0), (HALF, HALF, 1)]), (64, 64, [(0, 300_000, 2), (300_000, 700_000, 3)])])


@pytest.mark.parametrize(
    ("dim", "min_partition", "cuts"),
    [
        (128, 32, [[32] * 4, [64, 64]]),
        (256, 32, [[32] * 8, [64] * 4, [128, 128]]),
        (100, 32, [[36, 32, 32]]),
        (64, 64, []),
        (12, 4, [[4, 4, 4]]),
        (10, 3, [[4, 3, 3]]),
    ],
)
def test_column_cuts(dim: int, min_partition: int, cuts: list[list[int]]) -> None:
    assert column_cuts(dim, min_partition) == cuts


def test_grid_block_costs_like_a_table_row_wise_block_of_its_piece() -> None:
    topo = Topology(16, local_world_size=8)
    work = Workload(topology=topo, batch_size=1024)
    spec = table_specs({"": [bag("t", ROWS, 128)]}, {}, 16)[0]
    narrow = table_specs({"": [bag("t", ROWS, 32)]}, {}, 16)[0]
    assert shard_perf(spec, work, GRID, HALF, 32) == shard_perf(narrow, work, ShardingType.TABLE_ROW_WISE, HALF, 32)


@pytest.mark.parametrize("frac", [0.25, 0.5, 1.0])
def test_table_row_wise_block_pays_ids_and_lookup_only(frac: float) -> None:
    """A block's own cost: ids in (the same-host share (L - 1) / W over the intra-host link) and
    the lookup; its output is charged per host (below), not per block."""
    topo = Topology(16, local_world_size=8)
    free_link = Topology(16, local_world_size=8, intra_host_bw=1e30)
    spec = table_specs({"": [bag("t", ROWS, 128)]}, {}, 16)[0]
    rows = int(ROWS * frac)

    def cost(t: Topology) -> float:
        return shard_perf(spec, Workload(topology=t, batch_size=1024), ShardingType.TABLE_ROW_WISE, rows, 128)

    ids = 1024 * 16 * frac
    assert cost(topo) - cost(free_link) == pytest.approx(ids * 8 * 7 / 16 / 4.5e11, rel=1e-9)


def _two_step(world: int, local: int, k: int, index: int, rank: int) -> float:
    """Step 1: 2 (k-1)/k of the [B, 32] partial over NVLink; step 2 and back: [1024, 32] to each source
    of the holder's chunk (s * k // W == index), over NVLink on its host, the network off it, nothing to itself."""
    partial = 1024 * world * 32 * 4  # a 32-column piece, one bag per sample
    chunk = [s for s in range(world) if s * k // world == index]
    near = sum(1 for s in chunk if s // local == rank // local and s != rank)
    away = sum(1 for s in chunk if s // local != rank // local)
    per = 2 * 1024 * 32 * 4
    return (2 * partial * (k - 1) / k + near * per) / 4.5e11 + away * per / 5.0e10


@pytest.mark.parametrize(("world", "local"), [(16, 8), (16, 1), (8, 8), (64, 8)])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_holder_output_is_the_two_step_traffic(world: int, local: int, k: int) -> None:
    """Each holder pays the step-1 exchange and its own chunk of sources' sums home (out and back);
    without a position, the dearest chunk: as many of its sources off the host as there can be."""
    k = min(k, local)
    topo = Topology(world, local_world_size=local)
    work = Workload(topology=topo, batch_size=1024)
    spec = table_specs({"": [bag("t", ROWS, 128)]}, {}, world)[0]
    holders = list(range(local - k, local))  # the last k ranks of host 0
    for i, r in enumerate(holders):
        want = _two_step(world, local, k, i, r)
        assert holder_output_seconds(spec, work, 32, k, r, i) == pytest.approx(want, rel=1e-12)
        assert holder_output_seconds(spec, work, 32, k) >= want * (1 - 1e-12)
    sources = -(-world // k)
    away = min(sources, world - local)
    per = 2 * 1024 * 32 * 4
    step1 = 2 * 1024 * world * 32 * 4 * (k - 1) / k
    worst = (step1 + (sources - away) * per) / 4.5e11 + away * per / 5.0e10
    assert holder_output_seconds(spec, work, 32, k) == pytest.approx(worst, rel=1e-12)


def test_a_holder_whose_chunk_is_off_its_host_pays_more() -> None:
    """W = 64, 8 per host, a piece on ranks 0 and 1: holder 0 sends home to sources 0..31 (8 on its
    host: 7 over NVLink, 1 itself), holder 1 to 32..63, all over the network: 32 against 24 x 2 x [B, 32]
    off the host. An all-to-all split by destination (56/64 off the host for both) hid the difference."""
    topo = Topology(64, local_world_size=8)
    work = Workload(topology=topo, batch_size=1024)
    spec = table_specs({"": [bag("t", ROWS, 128)]}, {}, 64)[0]
    charges = host_charges(spec, work, GRID, [(0, 0, 32), (1, 0, 32)])
    assert charges[0] == pytest.approx(_two_step(64, 8, 2, 0, 0), rel=1e-12)
    assert charges[1] == pytest.approx(_two_step(64, 8, 2, 1, 1), rel=1e-12)
    assert charges[1] > 1.2 * charges[0]


def test_only_holders_pay_for_a_piece() -> None:
    """Piece (0, 32) on ranks 0 and 1 (k = 2), piece (32, 32) on rank 2, piece (64, 64) on rank 8 of
    host 1: those ranks pay once per piece they hold (each for its chunk); the host's other ranks nothing."""
    topo = Topology(16, local_world_size=8)
    work = Workload(topology=topo, batch_size=1024)
    spec = table_specs({"": [bag("t", ROWS, 128)]}, {}, 16)[0]
    shards = [(0, 0, 32), (1, 0, 32), (2, 32, 32), (8, 64, 64)]
    assert host_charges(spec, work, GRID, shards) == pytest.approx(
        {
            0: holder_output_seconds(spec, work, 32, 2, 0, 0),
            1: holder_output_seconds(spec, work, 32, 2, 1, 1),
            2: holder_output_seconds(spec, work, 32, 1, 2, 0),
            8: holder_output_seconds(spec, work, 64, 1, 8, 0),
        }
    )
    # a second holder halves what leaves the host, but adds the exchange inside it
    one = holder_output_seconds(spec, work, 32, 1, 0, 0)
    pair = [holder_output_seconds(spec, work, 32, 2, 0, 0), holder_output_seconds(spec, work, 32, 2, 1, 1)]
    assert min(pair) < one < sum(pair)
    assert host_charges(spec, work, ShardingType.ROW_WISE, shards) == {}


def test_plan_costs_are_blocks_plus_host_charges() -> None:
    """The planner's per-rank estimate of a plan it made = its shards' costs + the per-host charges."""
    tables = {"ebc": [bag(f"t{i}", 40_000_000, 128) for i in range(4)] + [bag("s", 2_000_000, 64)]}
    topo = Topology(128, local_world_size=8)
    work = Workload(topology=topo, batch_size=2048)
    host_kinds = ["table_row_wise", "grid_shard"]
    cons = {f"t{i}": ParameterConstraints(sharding_types=host_kinds[i % 2 :]) for i in range(4)}
    plan = EmbeddingShardingPlanner(topo, batch_size=2048, constraints=cons).plan(tables)
    specs = {s.name: s for s in table_specs(tables, {}, 128)}
    want = [0.0] * 128
    kinds = set()
    for name, ps in plan.plan["ebc"].items():
        kinds.add(ps.sharding_type)
        for s in ps.shards:
            want[s.rank] += shard_perf(specs[name], work, ps.sharding_type, *s.shard_sizes)
        blocks = [(s.rank, s.shard_offsets[1], s.shard_sizes[1]) for s in ps.shards]
        for r, c in host_charges(specs[name], work, ps.sharding_type, blocks).items():
            want[r] += c
    assert kinds & {GRID, ShardingType.TABLE_ROW_WISE}
    assert plan.stats is not None and list(plan.stats.rank_cost) == pytest.approx(want, rel=1e-9)


def test_given_grid_plan_is_kept_and_round_trips() -> None:
    tables = {"ebc": [bag("big", ROWS, 128), bag("small", 1_000, 32)]}
    topo = Topology(4, local_world_size=2)
    plan = EmbeddingShardingPlanner(topo, batch_size=128).plan(tables, fixed={"big": VALID})
    assert plan.plan["ebc"]["big"] == VALID
    check_plan(plan, tables, topo)
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan and again.plan["ebc"]["big"].sharding_type is GRID
    assert "grid_shard" in str(plan) and "r3:[300000,64]+[700000,64]" in str(plan)


@pytest.mark.parametrize(
    ("sharding", "match"),
    [
        (
            grid([(0, 64, [(0, ROWS, 0)]), (96, 32, [(0, ROWS, 1)])]),
            r"grid_shard column piece 1 must start at column 64 with > 0 columns, got offsets \(0, 96\)",
        ),
        (
            grid([(0, 64, [(0, HALF, 1), (HALF, HALF, 2)]), (64, 64, [(0, ROWS, 3)])]),
            r"grid_shard column piece 0 \(columns \[0, 64\)\) ranks \[1, 2\] span hosts \[0, 1\] "
            r"\(local_world_size 2\)",
        ),
        (
            grid([(0, 64, [(0, ROWS, 0)]), (64, 64, [(0, HALF, 3), (HALF, HALF, 3)])]),
            r"grid_shard column piece 1 \(columns \[64, 128\)\) puts two row blocks on one rank: ranks \[3, 3\]",
        ),
        (
            grid([(0, 64, [(0, 600_000, 0)]), (64, 64, [(0, ROWS, 1)])]),
            r"grid_shard column piece 0 \(columns \[0, 64\)\) shards cover 600000 rows, the table has 1000000",
        ),
        (
            grid([(0, 64, [(0, HALF, 0), (HALF + 1, HALF - 1, 1)]), (64, 64, [(0, ROWS, 1)])]),
            r"grid_shard column piece 0 \(columns \[0, 64\)\) shard 1 must start at \(500000, 0\) "
            r"with > 0 rows and 64 columns",
        ),
        (
            grid([(0, 64, [(0, ROWS, 0)]), (64, 32, [(0, ROWS, 1)])]),
            "grid_shard column pieces cover 96 columns, the table has 128",
        ),
    ],
)
def test_invalid_grid_plan_rejected(sharding: ParameterSharding, match: str) -> None:
    planner = EmbeddingShardingPlanner(Topology(4, local_world_size=2), batch_size=128)
    with pytest.raises(PlannerError, match=match):
        planner.plan({"ebc": [bag("big", ROWS, 128)]}, fixed={"big": sharding})


def _pieces(ps: ParameterSharding) -> dict[int, list[ShardMetadata]]:
    out: dict[int, list[ShardMetadata]] = {}
    for s in ps.shards:
        out.setdefault(s.shard_offsets[1], []).append(s)
    return out


def test_grid_spreads_a_table_over_hosts() -> None:
    """4 comm-bound tables on 16 hosts: each cut into 4 column pieces of 32, each piece row-blocked
    over all 8 ranks of its own host (8 holders each send 1/8 of the piece's output home), so every
    rank holds one block; without grid_shard 12 hosts would stay idle (4x slower)."""
    tables = {"ebc": [bag(f"t{i}", 40_000_000, 128) for i in range(4)]}
    topo = Topology(128, local_world_size=8)
    wide = {f"t{i}": ParameterConstraints(min_partition=32) for i in range(4)}
    plan = EmbeddingShardingPlanner(topo, batch_size=2048, constraints=wide).plan(tables)
    check_plan(plan, tables, topo)
    hosts, holders = set(), []
    for ps in plan.plan["ebc"].values():
        assert ps.sharding_type is GRID
        pieces = _pieces(ps)
        assert sorted(pieces) == [0, 32, 64, 96]
        for blocks in pieces.values():
            (host,) = {topo.host_of(b.rank) for b in blocks}
            assert len(blocks) == 8
            hosts.add(host)
            holders.extend(b.rank for b in blocks)
    assert hosts == set(range(16)) and sorted(holders) == list(range(128))
    no_grid = [t for t in ShardingType if t is not GRID]
    cons = {f"t{i}": ParameterConstraints(sharding_types=no_grid, min_partition=32) for i in range(4)}
    narrower = EmbeddingShardingPlanner(topo, batch_size=2048, constraints=cons).plan(tables)
    assert plan.stats is not None and narrower.stats is not None
    assert narrower.stats.max_cost > 3 * plan.stats.max_cost


def test_grid_not_used_when_disallowed_or_too_narrow() -> None:
    tables = {"ebc": [bag(f"t{i}", 40_000_000, 32) for i in range(16)]}  # 32 columns: no column cut of 32
    cons = {f"t{i}": ParameterConstraints(min_partition=32) for i in range(16)}
    plan = EmbeddingShardingPlanner(Topology(128, local_world_size=8), batch_size=2048, constraints=cons).plan(tables)
    assert all(ps.sharding_type is not GRID for ps in plan.plan["ebc"].values())


def test_grid_only_on_a_narrow_table_names_the_reason() -> None:
    cons = {"t": ParameterConstraints(sharding_types=["grid_shard"], min_partition=16)}
    with pytest.raises(
        PlannerError,
        match=r"table 't': no sharding type fits .* grid_shard needs at least 2 x min_partition columns "
        r"\(the table has 24, min_partition 16\)",
    ):
        EmbeddingShardingPlanner(Topology(2), constraints=cons).plan({"": [bag("t", 100, 24)]})


@pytest.mark.parametrize("world", [64, 512])
def test_skipping_grid_cuts_keeps_the_cheapest(world: int) -> None:
    """fill_grid skips cuts whose least total is above the best found: it returns what trying every cut
    (ties to the earlier cut) returns."""
    from lightning_shardrec.planner.search.enumerate import table_options
    from lightning_shardrec.planner.search.fill import RankLoads
    from lightning_shardrec.planner.search.grid import _place_cut, fill_grid

    topo = Topology(world, local_world_size=8)
    work = Workload(topology=topo, batch_size=16384)
    spec = table_specs({"": [bag("t", 40_000_000, 256)]}, {}, world)[0]
    opt = table_options(spec, work)
    assert len(opt.grid_cuts) >= 4
    for limit in (opt.tw_cost / 64, opt.tw_cost / 16, opt.tw_cost / 4):
        ranks = RankLoads([0.0] * world, [float(topo.memory_cap)] * world)
        every = [_place_cut(opt, work, cut, ranks, limit, None, True) for cut in opt.grid_cuts]
        fits = [(p.total_cost, i) for i, p in enumerate(every) if p is not None]
        got = fill_grid(opt, work, ranks, limit, None, True)
        assert (got is None) == (not fits)
        if got is not None:
            assert got == every[min(fits)[1]]
