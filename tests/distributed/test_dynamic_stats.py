"""dynamic_stats() of a sharded model: each table's figures summed over ranks equal the unsharded module's."""

from __future__ import annotations

import torch

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.testing import run_ranks

BATCH, STEPS = 8, 5


def _module() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=32, feature_names=["u"],
                           dynamic=DynamicConfig(num_buckets=4, ttl_steps=2)),
        EmbeddingBagConfig(name="item", embedding_dim=4, num_embeddings=12, feature_names=["i"],
                           dynamic=DynamicConfig(num_buckets=3, eviction="lfu", min_count=2, candidates_per_bucket=2)),
        EmbeddingBagConfig(name="s", embedding_dim=4, num_embeddings=5, feature_names=["c"]),
    ])


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: ``lengths [3 * BATCH]`` (u, i, c) and raw ids from a pool that drifts by 7 ids a step."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        lengths = torch.randint(0, 4, (3 * BATCH,), generator=gen)
        n_ui, n_c = int(lengths[: 2 * BATCH].sum()), int(lengths[2 * BATCH :].sum())
        raw = (torch.randint(7 * step, 7 * step + 40, (n_ui,), generator=gen) * 1_000_003) - 2**40
        out.append((lengths, torch.cat([raw, torch.randint(0, 5, (n_c,), generator=gen)])))
    return out


def _kjt(lengths: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` of the global batch."""
    per_key = lengths.view(3, BATCH)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), per_key.reshape(-1).cumsum(0)]).view(-1)
    parts = [values[int(starts[k * BATCH + lo]) : int(starts[k * BATCH + hi])] for k in range(3)]
    return KeyedJaggedTensor(["u", "i", "c"], torch.cat(parts), lengths=per_key[:, lo:hi].reshape(-1))


def _plan(world: int) -> ShardingPlan:
    fused = EmbeddingComputeKernel.FUSED
    blocks = [(0, 16, 0), (16, 16, 1)] if world == 2 else [(0, 32, 0)]  # whole buckets of 8 slots
    user = ParameterSharding(ShardingType.ROW_WISE, fused, [r for *_, r in blocks],
                             [ShardMetadata((a, 0), (n, 4), r) for a, n, r in blocks])
    item = ParameterSharding(ShardingType.TABLE_WISE, fused, [world - 1], [ShardMetadata((0, 0), (12, 4), world - 1)])
    s = ParameterSharding(ShardingType.TABLE_WISE, fused, [0], [ShardMetadata((0, 0), (5, 4), 0)])
    return ShardingPlan({"": {"user": user, "item": item, "s": s}})


def sharded_stats(rank: int, world: int):
    from lightning_shardrec.distributed import DistributedModelParallel

    dmp = DistributedModelParallel(_module(), plan=_plan(world), embedding_optimizer="sgd")
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    for lengths, values in _batches():
        dmp(_kjt(lengths, values, lo, hi)).values().sum().backward()
    local = sorted(dmp.module.dynamic_mappers())
    return local, dmp.dynamic_stats()


def test_sums_over_ranks_equal_the_unsharded_module():
    plain = _module()
    for lengths, values in _batches():
        plain(_kjt(lengths, values, 0, BATCH)).values().sum().backward()
    want = plain.dynamic_stats()
    assert want["user"]["expirations"] > 0 and want["item"]["evictions"] + want["item"]["dropped_candidates"] > 0
    (local0, stats0), (local1, stats1) = run_ranks(sharded_stats, 2)
    assert (local0, local1) == (["user"], ["item", "user"])  # rank 0 holds no bucket of 'item', still reduces
    assert stats0 == stats1 == want


def sharded_windows(rank: int, world: int):
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.sharded.dynamic_stats import full_table_warnings

    dmp = DistributedModelParallel(_module(), plan=_plan(world), embedding_optimizer="sgd")
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    windows = []
    for step, (lengths, values) in enumerate(_batches()):
        dmp(_kjt(lengths, values, lo, hi)).values().sum().backward()
        if step in (1, STEPS - 1):
            stats = dmp.dynamic_stats(new_window=True)
            windows.append((stats, full_table_warnings(stats, 0.1)))
    return windows


def test_windows_and_full_table_warnings_over_ranks_equal_one_process():
    """Two windows (steps 0-1, 2-4): lookups, misses, distinct ids, miss rate, suggestion and warnings."""
    from lightning_shardrec.distributed.sharded.dynamic_stats import dynamic_stats, full_table_warnings

    plain, want = _module(), []
    for step, (lengths, values) in enumerate(_batches()):
        plain(_kjt(lengths, values, 0, BATCH)).values().sum().backward()
        if step in (1, STEPS - 1):
            stats = dynamic_stats(plain, new_window=True)
            want.append((stats, full_table_warnings(stats, 0.1)))
    first, last = want[0][0]["item"], want[1][0]["item"]
    assert first["window_misses"] + last["window_misses"] == last["misses"] > 0  # the windows split the run
    assert last["miss_rate"] == last["window_misses"] / last["window_lookups"] > 0.1
    assert last["suggested_capacity"] > last["capacity"] == 12 and last["suggested_capacity"] % 3 == 0  # 3 buckets
    assert any("dynamic table 'item' is full" in w for w in want[1][1])
    rank0, rank1 = run_ranks(sharded_windows, 2)
    assert rank0 == rank1 == want
