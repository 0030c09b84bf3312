"""Hand-made plans and batch splits shared by the sharded EBC/EC exactness tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_shardrec import KeyedJaggedTensor
from lightning_shardrec.planner import EmbeddingComputeKernel, ParameterSharding, ShardingType, ShardMetadata

GLOBAL_BATCH = 12
TOL = {"rtol": 1e-5, "atol": 1e-6}


def row_blocks(rows: int, n: int) -> list[tuple[int, int]]:
    """``n`` uneven row blocks ``(start, end)`` covering ``[0, rows)``."""
    bounds = [0] + sorted({max(1, rows * (k + 1) // (n + 1) + k) for k in range(n - 1)}) + [rows]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def shards_for(st: ShardingType, i: int, rows: int, dim: int, world: int) -> list[ShardMetadata]:
    """Table ``i``'s shards under ``st``, cut unevenly where the type allows."""
    cuts = [(0, 4), (4, 4)] if dim == 8 else [(0, 8), (8, 4)]  # 12 = 8 + 4: pieces of two widths
    if st is ShardingType.TABLE_WISE:
        return [ShardMetadata((0, 0), (rows, dim), (i + 1) % world)]
    if st is ShardingType.COLUMN_WISE:
        return [ShardMetadata((0, c), (rows, w), (i + j) % world) for j, (c, w) in enumerate(cuts)]
    if st is ShardingType.DATA_PARALLEL:
        return [ShardMetadata((0, 0), (rows, dim), r) for r in range(world)]
    if st is ShardingType.GRID_SHARD:  # each column piece in its own row blocks (a rank may hold two pieces)
        return [
            ShardMetadata((a, c), (b - a, w), (k + i + j) % world)
            for j, (c, w) in enumerate(cuts)
            for k, (a, b) in enumerate(row_blocks(rows, min(max(world - j, 1), rows)))
        ]
    # row-wise, table-row-wise: uneven blocks; fewer blocks than ranks when rows < world
    return [
        ShardMetadata((a, 0), (b - a, dim), (k + i) % world)
        for k, (a, b) in enumerate(row_blocks(rows, min(world, rows)))
    ]


def plan_of(types: dict[str, str], shapes: dict[str, tuple[int, int]], world: int) -> dict[str, ParameterSharding]:
    """Table name -> its sharding under ``types[name]``, for tables of ``shapes`` (rows, dim)."""
    out = {}
    for i, (name, (rows, dim)) in enumerate(shapes.items()):
        st = ShardingType(types[name])
        shards = shards_for(st, i, rows, dim, world)
        kernel = EmbeddingComputeKernel.DENSE if st is ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED
        out[name] = ParameterSharding(st, kernel, [s.rank for s in shards], shards)
    return out


def splits(world: int, uneven: bool) -> list[int]:
    """Every rank's share of ``GLOBAL_BATCH``; ``uneven``: rank 0 gets none, the rest uneven."""
    if uneven and world > 1:
        sizes = [0] + [GLOBAL_BATCH // (world - 1)] * (world - 1)
        sizes[-1] += GLOBAL_BATCH - sum(sizes)
        return sizes
    base = [GLOBAL_BATCH // world] * world
    base[-1] += GLOBAL_BATCH - sum(base)
    return base


def random_steps(seed: int, weighted: bool, rows: dict[str, int], steps: int) -> list[tuple]:
    """``steps`` global batches ``(bags, weights, dense [G, 3], labels [G])`` as plain lists, so every
    rank can slice its part; 0-3 ids per bag, and feature ``f1`` empty in half the samples."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        bags = {
            f: [
                torch.randint(0, n_rows, (int(n),), generator=g).tolist()
                for n in torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
            ]
            for f, n_rows in rows.items()
        }
        for i in range(GLOBAL_BATCH // 2):
            bags["f1"][i] = []
        wts = (
            {f: [torch.rand(len(b), generator=g).add(0.5).tolist() for b in bags[f]] for f in rows}
            if weighted
            else None
        )
        dense = torch.randn(GLOBAL_BATCH, 3, generator=g)
        label = torch.rand(GLOBAL_BATCH, generator=g).round()
        out.append((bags, wts, dense, label))
    return out


def kjt_of(bags: dict, wts: dict | None, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` of one of :func:`random_steps`' batches, features in ``bags``' order."""
    features = list(bags)
    lengths = [len(bags[f][i]) for f in features for i in range(lo, hi)]
    values = [v for f in features for i in range(lo, hi) for v in bags[f][i]]
    weights = None if wts is None else torch.tensor([w for f in features for i in range(lo, hi) for w in wts[f][i]])
    return KeyedJaggedTensor(
        features, torch.tensor(values, dtype=torch.long), weights, torch.tensor(lengths, dtype=torch.long)
    )


def assert_matches_unsharded(case, model, opt, steps: list[tuple], sizes: list[int], results: list, tables) -> None:
    """Train the unsharded ``model`` (``model(dense, kjt) -> (logits, pooled)``, head ``model.top``,
    tables ``model.ebc``) on whole :func:`random_steps` batches; every rank's ``(first pooled, shards,
    top state)`` must match: its slice of the first forward, the head and each table assembled from shards."""
    pooled_first = None
    for bags, wts, dense, label in steps:
        logits, pooled = model(dense, kjt_of(bags, wts, 0, GLOBAL_BATCH))
        pooled_first = pooled.detach() if pooled_first is None else pooled_first
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(logits, label, reduction="mean").backward()
        opt.step()
    lo = 0
    for rank, ((first, _, top), size) in enumerate(zip(results, sizes, strict=True)):
        torch.testing.assert_close(first, pooled_first[lo : lo + size], **TOL, msg=f"{case} rank {rank} forward")
        for k, v in model.top.state_dict().items():
            torch.testing.assert_close(top[k], v, **TOL, msg=f"{case} rank {rank} dense {k}")
        lo += size
    for table in tables:
        want = model.ebc.embedding_bags[table].weight.detach()
        got = torch.full_like(want, float("nan"))
        for _, shards, _ in results:
            for (r0, c0), w in shards.get(f"ebc.embedding_bags.{table}.weight", []):
                got[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
        torch.testing.assert_close(got, want, **TOL, msg=f"{case} table {table}")
