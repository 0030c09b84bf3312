"""Dynamic tables, unsharded: hashing, id -> slot mapping, admission, eviction, training."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from lightning_shardrec import (
    DynamicConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from lightning_shardrec.modules import (
    DynamicIdMapper,
    EvictionPolicy,
    bucket_of,
)
from lightning_shardrec.modules.dynamic.hashing import mix64
from lightning_shardrec.modules.dynamic.tables import fresh_rows
from tests.modules._dynamic_reference import MASK, ODD_IDS, ReferenceMapper, splitmix64, stream
from tests.modules.test_dynamic_group import tensor_ops_only


def test_hash_of_negative_and_huge_ids_is_splitmix64() -> None:
    got = [h & MASK for h in mix64(torch.tensor(ODD_IDS)).tolist()]
    assert got == [splitmix64(x & MASK) for x in ODD_IDS]
    buckets = bucket_of(torch.tensor(ODD_IDS), 7).tolist()
    assert buckets == [(splitmix64(x & MASK) >> 1) % 7 for x in ODD_IDS]


CASES = [
    DynamicConfig(num_buckets=3),
    DynamicConfig(num_buckets=3, eviction="lfu"),
    DynamicConfig(num_buckets=3, min_count=3, candidates_per_bucket=2),
    DynamicConfig(num_buckets=3, eviction=EvictionPolicy.LFU, min_count=2, ttl_steps=3),
    DynamicConfig(num_buckets=1, ttl_steps=2),
]


@pytest.mark.parametrize("config", CASES, ids=lambda c: f"{c.eviction.value}-m{c.min_count}-ttl{c.ttl_steps}")
def test_mapper_matches_reference(config: DynamicConfig) -> None:
    capacity = 6 if config.num_buckets == 3 else 4
    mapper = DynamicIdMapper("t", config, capacity)
    buckets, slots = config.layout(capacity, "t")
    ref = ReferenceMapper(
        buckets,
        slots,
        config.candidate_slots(slots),
        config.min_count,
        config.eviction is EvictionPolicy.LFU,
        config.ttl_steps,
    )
    for step, batch in enumerate(stream(30, 25, 9, seed=capacity + config.min_count)):
        train = step % 5 != 4
        result = mapper.lookup(torch.tensor(batch), step, train)
        want, new = ref.lookup(batch, step, train)
        assert result.slots.tolist() == want, step
        assert dict(zip(result.new_slots.tolist(), result.new_generations.tolist(), strict=True)) == new
    stats = mapper.stats()
    assert {k: stats[k] for k in ref.counters()} == ref.counters()
    assert stats["evictions"] > 0 or stats["expirations"] > 0  # the stream overflows the table


def test_admission_after_min_count() -> None:
    mapper = DynamicIdMapper("t", DynamicConfig(num_buckets=1, min_count=3), 4)
    seen = [
        mapper.lookup(torch.tensor(batch), step, True).slots.tolist()
        for step, batch in enumerate([[42], [42, 9], [42], [42]])
    ]
    assert seen == [[-1], [-1, -1], [0], [0]]
    assert mapper.lookup(torch.tensor([9, 9]), 4, True).slots.tolist() == [1, 1]  # 1 + 2 sightings
    assert mapper.stats()["misses"] == 3 and mapper.stats()["admissions"] == 2


def test_lru_evicts_least_recent_and_lfu_least_frequent() -> None:
    batches = [[2, 2, 2], [1], [3], [1], [4]]  # one bucket of 3 slots: the 4th id must evict
    for policy, evicted in (("lru", 2), ("lfu", 3)):
        mapper = DynamicIdMapper("t", DynamicConfig(num_buckets=1, eviction=policy), 3)
        for step, batch in enumerate(batches):
            mapper.lookup(torch.tensor(batch), step, True)
        held = set(mapper.slot_ids.tolist())
        assert held == {1, 2, 3, 4} - {evicted}, policy
        assert mapper.stats()["evictions"] == 1


def test_ties_go_to_the_lowest_slot_and_new_ids_by_count_then_id() -> None:
    mapper = DynamicIdMapper("t", DynamicConfig(num_buckets=1), 2)
    mapper.lookup(torch.tensor([10, 20]), 0, True)
    out = mapper.lookup(torch.tensor([30, 5, 30]), 1, True)  # 30 seen twice wins the tie of two old rows
    assert out.slots.tolist() == [0, 1, 0]


def test_ttl_frees_rows_not_seen_for_ttl_steps() -> None:
    mapper = DynamicIdMapper("t", DynamicConfig(num_buckets=1, ttl_steps=2), 4)
    mapper.lookup(torch.tensor([1, 2]), 0, True)
    mapper.lookup(torch.tensor([2]), 2, True)
    assert mapper.lookup(torch.tensor([1, 2]), 2, False).slots.tolist() == [0, 1]
    assert mapper.lookup(torch.tensor([1, 2]), 3, False).slots.tolist() == [-1, 1]  # eval: stale reads miss
    out = mapper.lookup(torch.tensor([2, 1]), 3, True)
    assert out.slots.tolist() == [1, 0] and out.new_slots.tolist() == [0]  # 1 re-enters as new
    assert mapper.stats()["expirations"] == 1


def test_batch_order_does_not_change_results() -> None:
    config = DynamicConfig(num_buckets=2, eviction="lfu", min_count=2)
    a, b = DynamicIdMapper("t", config, 4), DynamicIdMapper("t", config, 4)
    rng = random.Random(0)
    for step, batch in enumerate(stream(20, 20, 10, seed=3)):
        perm = list(range(len(batch)))
        rng.shuffle(perm)
        sa = a.lookup(torch.tensor(batch), step, True).slots
        sb = b.lookup(torch.tensor([batch[p] for p in perm]), step, True).slots
        assert sb.tolist() == sa[perm].tolist()
    assert a.stats() == b.stats()


def test_bucket_ranges_map_like_the_whole_table() -> None:
    config = DynamicConfig(num_buckets=5, eviction="lru", min_count=2, ttl_steps=4)
    whole = DynamicIdMapper("t", config, 10)
    parts = [DynamicIdMapper("t", config, 10, bucket_range=r) for r in ((0, 2), (2, 3), (3, 5))]
    for step, batch in enumerate(stream(40, 40, 12, seed=5)):
        ids = torch.tensor(batch)
        want = whole.lookup(ids, step, True)
        got = torch.full_like(ids, -1)
        new = []
        bucket = bucket_of(ids, 5)
        for p in parts:
            mine = (bucket >= p.bucket_lo) & (bucket < p.bucket_hi)
            r = p.lookup(ids[mine], step, True)
            got[mine] = r.slots
            new += list(zip(r.new_slots.tolist(), r.new_generations.tolist(), strict=True))
        assert got.tolist() == want.slots.tolist()
        assert sorted(new) == sorted(zip(want.new_slots.tolist(), want.new_generations.tolist(), strict=True))
    summed = {k: sum(p.stats()[k] for p in parts) for k in whole.stats()}
    assert summed == whole.stats() and whole.stats()["evictions"] > 0
    assert whole.counters.shape == (5, 5) and [p.counters.shape[0] for p in parts] == [2, 1, 2]
    assert torch.equal(torch.cat([p.counters for p in parts]), whole.counters)  # per bucket: exact on reshard


def test_fresh_rows_depend_only_on_table_slot_generation() -> None:
    table = EmbeddingBagConfig(
        name="t",
        embedding_dim=8,
        num_embeddings=64,
        feature_names=["f"],
        weight_init_min=-0.5,
        weight_init_max=0.25,
        dynamic=DynamicConfig(),
    )
    w = torch.empty(64, 8)
    a = fresh_rows(table, torch.tensor([3, 9]), torch.tensor([1, 1]), w)
    b = fresh_rows(table, torch.tensor([9, 3, 3]), torch.tensor([1, 1, 2]), w)
    torch.testing.assert_close(a, b[[1, 0]], rtol=0, atol=0)
    assert not torch.equal(b[1], b[2]) and float(a.min()) >= -0.5 and float(a.max()) < 0.25
    custom = EmbeddingBagConfig(
        name="t",
        embedding_dim=8,
        num_embeddings=64,
        feature_names=["f"],
        init_fn=lambda x: x.normal_(),
        dynamic=DynamicConfig(),
    )
    c = fresh_rows(custom, torch.tensor([3, 9]), torch.tensor([1, 1]), w)
    torch.testing.assert_close(c, fresh_rows(custom, torch.tensor([3, 9]), torch.tensor([1, 1]), w))


def test_defaults_layout_and_positional_order() -> None:
    config = DynamicConfig()
    assert (config.eviction, config.ttl_steps, config.min_count) == (EvictionPolicy.LRU, None, 1)
    assert config.num_buckets is None and config.layout(4096, "t") == (256, 16)
    assert config.layout(1000, "t") == (100, 10) and config.layout(1001, "t") == (77, 13)
    assert config.layout(7, "t") == (1, 7) and DynamicConfig(num_buckets=10).layout(1000, "t") == (10, 100)
    assert config.candidate_slots(8) == 0 and DynamicConfig(min_count=2).candidate_slots(8) == 8
    bag = EmbeddingBagConfig(
        8, 2, "t", "FP32", ["f"], None, None, None, None, False, None, None, False, None, False, False, "MEAN",
        dynamic=config,
    )
    assert bag.pooling.value == "MEAN" and bag.dynamic is config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eviction": "fifo"}, r"DynamicConfig: eviction must be one of lru, lfu; got 'fifo'"),
        ({"ttl_steps": 0}, r"DynamicConfig: ttl_steps must be an int >= 1 or None, got 0"),
        ({"min_count": 0}, r"DynamicConfig: min_count must be an int >= 1, got 0"),
        ({"min_count": 1.5}, r"DynamicConfig: min_count must be an int >= 1, got 1.5"),
        ({"num_buckets": -2}, r"DynamicConfig: num_buckets must be an int >= 1 or None, got -2"),
        ({"candidates_per_bucket": True}, r"candidates_per_bucket must be an int >= 1 or None, got True"),
        ({"candidates_per_bucket": 5000}, r"candidates_per_bucket must be in \[1, 1024\], got 5000"),
        ({"seed": -1}, r"DynamicConfig: seed must be an int in \[0, 2\*\*31\), got -1"),
    ],
)
def test_bad_dynamic_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicConfig(**kwargs)


def test_bad_dynamic_table() -> None:
    def table(rows: int, dynamic: object) -> EmbeddingConfig:
        return EmbeddingConfig(name="user", embedding_dim=4, num_embeddings=rows, feature_names=["u"], dynamic=dynamic)

    with pytest.raises(
        ValueError,
        match=r"dynamic table 'user': num_buckets 3 must divide num_embeddings 10 "
        r"\(a divisor in \[1, 10\]\)",
    ):
        table(10, DynamicConfig(num_buckets=3))
    with pytest.raises(ValueError, match=r"dynamic table 'user': num_buckets 20 must divide num_embeddings 10"):
        table(10, DynamicConfig(num_buckets=20))
    with pytest.raises(
        ValueError,
        match=r"dynamic table 'user': 4096 rows in 2 buckets is 2048 slots per bucket; "
        r"at most 1024 are allowed \(use num_buckets >= 4\)",
    ):
        table(4096, DynamicConfig(num_buckets=2))
    with pytest.raises(
        ValueError,
        match=r"EmbeddingConfig\(name='user'\): dynamic must be a DynamicConfig or None, "
        r"got 'lru'",
    ):
        table(10, "lru")


def test_mapper_rejects_bad_bucket_ranges_and_foreign_ids() -> None:
    with pytest.raises(
        ValueError, match=r"dynamic table 't': bucket range \[2, 2\) is not a non-empty part of \[0, 4\)"
    ):
        DynamicIdMapper("t", DynamicConfig(num_buckets=4), 8, bucket_range=(2, 2))
    part = DynamicIdMapper("t", DynamicConfig(num_buckets=4), 8, bucket_range=(0, 1))
    ids = torch.arange(20)
    with pytest.raises(ValueError, match=r"dynamic table 't': ids outside buckets \[0, 1\) were sent to this mapper"):
        part.lookup(ids, 0, True)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "tensor-ops"])
@pytest.mark.parametrize("seed", range(6))
def test_mapper_matches_reference_on_random_configs_and_skewed_streams(seed: int, compiled: bool) -> None:
    """Random layouts and policies, skewed batches with repeats, drift, eval steps, the step as a tensor;
    the compiled loops and the sync-free tensor ops (the GPU's path) alike."""
    with contextlib.nullcontext() if compiled else tensor_ops_only():
        _match_reference_on_a_random_stream(seed)


def _match_reference_on_a_random_stream(seed: int) -> None:
    rng = random.Random(seed)
    buckets, slots = rng.choice([(1, 5), (2, 4), (4, 3), (3, 8)])
    config = DynamicConfig(
        num_buckets=buckets,
        eviction=rng.choice(["lru", "lfu"]),
        min_count=rng.choice([1, 1, 2, 3]),
        ttl_steps=rng.choice([None, 1, 4]),
        candidates_per_bucket=rng.choice([None, 1, 2]),
    )
    mapper = DynamicIdMapper("t", config, buckets * slots)
    ref = ReferenceMapper(
        buckets,
        slots,
        config.candidate_slots(slots),
        config.min_count,
        config.eviction is EvictionPolicy.LFU,
        config.ttl_steps,
    )
    pool = [rng.choice([-1, 1]) * rng.randrange(2**63) for _ in range(8 * buckets * slots)] + ODD_IDS
    for step in range(40):
        live = pool[step : step + 3 * buckets * slots]  # a window that drifts: new ids arrive, old ones fade
        batch = [live[min(int(rng.paretovariate(1.0)) - 1, len(live) - 1)] for _ in range(rng.randrange(0, 30))]
        train = rng.random() < 0.85
        result = mapper.lookup(torch.tensor(batch, dtype=torch.int64), torch.tensor(step), train)
        want, new = ref.lookup(batch, step, train)
        assert result.slots.tolist() == want, step
        assert dict(zip(result.new_slots.tolist(), result.new_generations.tolist(), strict=True)) == new, step
    stats = mapper.stats()
    assert {k: stats[k] for k in ref.counters()} == ref.counters()
    assert stats["admissions"] > 0 and stats["evictions"] + stats["expirations"] + stats["misses"] > 0
