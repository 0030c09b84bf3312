"""Checkpoints reshard into and out of grid plans: every weight and fused optimizer state
lands where the new plan puts it, for sharded (DCP) and full checkpoints.

Each cell gets a value that encodes its table, row and column (per-row states: row and
column piece), so a misplaced block cannot match by accident.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.testing import run_ranks

TABLES = {"t_big": (40, 8), "t_mid": (10, 12)}
CUTS = {"t_big": [(0, 4), (4, 4)], "t_mid": [(0, 8), (8, 4)]}
SALT = {"t_big": 1, "t_mid": 2}


def cell(table: str, what: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``[len(rows), len(cols)]`` values unique per (table, weight/state, row, column)."""
    return (SALT[table] * 100_000 + what * 10_000 + rows.unsqueeze(1) * 16 + cols.unsqueeze(0)).float()


def row_cell(table: str, rows: torch.Tensor, col0: int) -> torch.Tensor:
    return (SALT[table] * 100_000 + 90_000 + rows * 16 + col0).float()


def blocks(rows: int, n: int, shift: int) -> list[tuple[int, int]]:
    bounds = [0] + sorted({min(rows - 1, max(1, rows * (k + 1) // n + shift)) for k in range(n - 1)}) + [rows]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def plan_of(kind: str, world: int, local: int | None = None) -> dict[str, ParameterSharding]:
    """With ``local`` ranks per host, table-row-wise tables and grid pieces go inside hosts."""
    st = ShardingType(kind)
    out = {}
    hosts = world // (local or world)
    for i, (name, (rows, dim)) in enumerate(TABLES.items()):
        if local is not None and st in (ShardingType.GRID_SHARD, ShardingType.TABLE_ROW_WISE):
            cuts = CUTS[name] if st is ShardingType.GRID_SHARD else [(0, dim)]
            shards = []
            for j, (c, w) in enumerate(cuts):  # piece j of table i on host (i + j) % hosts, ranks reversed
                host = (i + j) % hosts
                ranks = list(range((host + 1) * local - 1, host * local - 1, -1))
                cut = blocks(rows, min(local, rows), j)
                shards += [ShardMetadata((a, c), (b - a, w), ranks[k]) for k, (a, b) in enumerate(cut)]
        elif st is ShardingType.GRID_SHARD:  # pieces cut into different row blocks, ranks rotated
            shards = [
                ShardMetadata((a, c), (b - a, w), (i + j + k) % world)
                for j, (c, w) in enumerate(CUTS[name])
                for k, (a, b) in enumerate(blocks(rows, min(world, rows), j))
            ]
        elif st is ShardingType.COLUMN_WISE:
            shards = [ShardMetadata((0, c), (rows, w), (i + j) % world) for j, (c, w) in enumerate(CUTS[name])]
        else:  # row_wise
            shards = [ShardMetadata((a, 0), (b - a, dim), k % world) for k, (a, b) in enumerate(blocks(rows, world, 1))]
        out[name] = ParameterSharding(st, EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards)
    return out


def make(world: int, kind: str, optim: str, local: int | None = None):
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.testing import local_world_size

    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[t]) for t, (n, d) in TABLES.items()
    ]
    ebc = EmbeddingBagCollection(configs)
    plan = ShardingPlan({"": plan_of(kind, world, local)})
    with local_world_size(local):
        return DistributedModelParallel(ebc, plan=plan, device="cpu", embedding_optimizer=optim).sharded


def fill(sharded) -> None:
    """Weights and states take their cells' values; step counters stay as they are."""
    module = sharded[""]
    with torch.no_grad():
        for table, shards in module.local_shards().items():
            for meta, w in shards:
                (r0, c0), (n, d) = meta.shard_offsets, meta.shard_sizes
                w.copy_(cell(table, 0, torch.arange(r0, r0 + n), torch.arange(c0, c0 + d)))
        for table, shards in module.local_states().items():
            for meta, state in shards:
                (r0, c0), (n, d) = meta.shard_offsets, meta.shard_sizes
                for k, (_, t) in enumerate(sorted(state.items())):
                    if t.dim() == 2:
                        t.copy_(cell(table, 1 + k, torch.arange(r0, r0 + n), torch.arange(c0, c0 + d)))
                    elif t.dim() == 1:
                        t.copy_(row_cell(table, torch.arange(r0, r0 + n), c0))


def blank(sharded) -> None:
    module = sharded[""]
    with torch.no_grad():
        for shards in module.local_shards().values():
            for _, w in shards:
                w.fill_(-1.0)
        for shards in module.local_states().values():
            for _, state in shards:
                for t in state.values():
                    if t.dim() > 0:
                        t.fill_(-1.0)


def held(sharded) -> list[tuple[str, tuple, tuple, torch.Tensor, dict[str, torch.Tensor]]]:
    """This rank's shards: (table, offsets, sizes, weight, {state name: state}), cloned."""
    module = sharded[""]
    states = {(t, m.shard_offsets): s for t, v in module.local_states().items() for m, s in v}
    out = []
    for t, shards in module.local_shards().items():
        for m, w in shards:
            state = {k: v.clone() for k, v in states[(t, m.shard_offsets)].items()}
            out.append((t, m.shard_offsets, m.shard_sizes, w.detach().clone(), state))
    return out


def save_run(rank, world, kind, optim, path, local=None):
    from lightning_shardrec.checkpoint import save_sharded

    sharded = make(world, kind, optim, local)
    fill(sharded)
    save_sharded(path, sharded, {}, {}, rank)


def load_run(rank, world, kind, optim, path, local=None):
    from lightning_shardrec.checkpoint import load_sharded

    sharded = make(world, kind, optim, local)
    blank(sharded)
    load_sharded(path, sharded, {}, rank)
    return held(sharded)


def full_run(rank, world, save_kind, load_kind, optim, local=None):
    """Gather a filled ``save_kind`` model's full state, load it into a blank ``load_kind`` model."""
    from lightning_shardrec.checkpoint import gather_full_state, load_full_state

    source = make(world, save_kind, optim, local)
    fill(source)
    weights, states = gather_full_state(source)
    target = make(world, load_kind, optim, local)
    blank(target)
    load_full_state(target, weights, states)
    return held(target)


def check(per_rank, saved_kind: str) -> None:
    """Every held block equals its cells; per-row states come from the saved piece holding its first column."""
    covered = {t: 0 for t in TABLES}
    for shards in per_rank:
        for table, (r0, c0), (n, d), w, state in shards:
            rows, cols = torch.arange(r0, r0 + n), torch.arange(c0, c0 + d)
            want_w = cell(table, 0, rows, cols)
            torch.testing.assert_close(w, want_w, rtol=0, atol=0, msg=f"{table} weight at {(r0, c0)}")
            saved_cols = [0] if saved_kind in ("row_wise", "table_row_wise") else [c for c, _ in CUTS[table]]
            for k, (name, t) in enumerate(sorted(state.items())):
                if t.dim() == 2:
                    want = cell(table, 1 + k, rows, cols)
                elif t.dim() == 1:
                    want = row_cell(table, rows, max(c for c in saved_cols if c <= c0))
                else:
                    continue
                torch.testing.assert_close(t, want, rtol=0, atol=0, msg=f"{table} state {name} at {(r0, c0)}")
            covered[table] += w.numel()
    assert covered == {t: n * d for t, (n, d) in TABLES.items()}, covered


# (world, kind, ranks per host: None = one host)
MOVES = [
    ((2, "grid_shard", None), (3, "row_wise", None)),
    ((3, "column_wise", None), (2, "grid_shard", None)),
    ((2, "grid_shard", None), (3, "grid_shard", None)),
    ((2, "grid_shard", None), (4, "grid_shard", 2)),  # into pieces on 2 hosts of 2 ranks
    ((4, "table_row_wise", 2), (3, "column_wise", None)),  # out of tables on 2 hosts
]


@pytest.mark.parametrize("optim", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize(("save", "load"), MOVES)
def test_sharded_checkpoint_reshards_grid(tmp_path: Path, optim: str, save, load) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(save_run, save[0], save[1], optim, path, save[2])
    check(run_ranks(load_run, load[0], load[1], optim, path, load[2]), save[1])


@pytest.mark.parametrize(
    ("world", "save_kind", "load_kind", "local"),
    [
        (3, "grid_shard", "row_wise", None),
        (3, "column_wise", "grid_shard", None),
        (4, "grid_shard", "table_row_wise", 2),
    ],
)
def test_full_state_moves_into_and_out_of_grid(world: int, save_kind: str, load_kind: str, local: int | None) -> None:
    check(run_ranks(full_run, world, save_kind, load_kind, "rowwise_adagrad", local), save_kind)


def gather_run(rank, world, kind, optim, piece_bytes=None):
    """``gather_full_state`` onto rank 0 (sent in pieces of ``piece_bytes``) and onto every rank, from the
    same filled model."""
    from lightning_shardrec.checkpoint import gather_full_state, sharded_state

    source = make(world, kind, optim)
    fill(source)
    default = sharded_state.PIECE_BYTES
    sharded_state.PIECE_BYTES = piece_bytes or default
    try:
        return gather_full_state(source, dst=0), gather_full_state(source)
    finally:
        sharded_state.PIECE_BYTES = default


@pytest.mark.parametrize(
    ("kind", "optim", "piece_bytes"),
    [
        ("grid_shard", "adagrad", None),
        ("row_wise", "rowwise_adagrad", None),
        ("grid_shard", "adagrad", 40),  # column pieces (16 or 32 bytes a row): 1-2 rows a piece, strided places
        ("row_wise", "rowwise_adagrad", 12),  # weights: a row a piece; the per-row state: 3 rows a piece
    ],
)
def test_full_state_gathers_on_rank_0_only(kind: str, optim: str, piece_bytes: int | None) -> None:
    results = run_ranks(gather_run, 3, kind, optim, piece_bytes)
    (weights, states), (every_w, every_s) = results[0]
    for table, (n, d) in TABLES.items():
        key = f"embedding_bags.{table}.weight"
        assert torch.equal(weights[key], cell(table, 0, torch.arange(n), torch.arange(d)))
    assert sorted(weights) == sorted(every_w) and sorted(states) == sorted(every_s)
    for key in every_w:
        assert torch.equal(weights[key], every_w[key]), key
        assert sorted(states[key]) == sorted(every_s[key])
        for name, t in every_s[key].items():
            assert torch.equal(states[key][name], t), (key, name)
    for on_zero, every in results[1:]:
        assert on_zero == ({}, {})  # no full table, no full state on the other ranks
        assert sorted(every[0]) == sorted(every_w)
