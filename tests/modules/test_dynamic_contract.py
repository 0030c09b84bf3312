"""docs/dynamic-tables.md ("Semantics") is the contract: one test per documented rule, each run through
the library and the plain-Python reference written from the docs (tests/modules/_dynamic_reference.py),
with the rule's own numbers checked explicitly."""

from __future__ import annotations

import random

import torch

from lightning_shardrec import DynamicConfig
from lightning_shardrec.inference.id_map import live_slots
from lightning_shardrec.modules import DynamicIdMapper, EvictionPolicy, bucket_of
from tests.modules._dynamic_reference import MASK, ODD_IDS, ReferenceMapper, bucket, splitmix64


class Both:
    """A mapper and the reference, fed the same batches at the table's own step; every lookup compared."""

    def __init__(self, config: DynamicConfig, capacity: int) -> None:
        self.mapper = DynamicIdMapper("t", config, capacity)
        b, s = config.layout(capacity, "t")
        lfu = config.eviction is EvictionPolicy.LFU
        self.ref = ReferenceMapper(b, s, config.candidate_slots(s), config.min_count, lfu, config.ttl_steps)
        self.width = s

    def step(self, ids: list[int], train: bool = True) -> tuple[list[int], dict[int, int]]:
        """One forward at the table's step: ``(slots, {new slot: generation})``, equal on both."""
        got = self.mapper.map(torch.tensor(ids, dtype=torch.int64), train)
        want, new = self.ref.lookup(ids, int(self.mapper.step) - int(train), train)
        assert got.slots.tolist() == want
        assert dict(zip(got.new_slots.tolist(), got.new_generations.tolist(), strict=True)) == new
        return want, new

    def stats(self) -> dict[str, int]:
        stats = self.mapper.stats()
        assert {k: stats[k] for k in self.ref.counters()} == self.ref.counters()
        return stats


def test_bucket_is_the_top_63_bits_of_splitmix64_mod_num_buckets() -> None:
    rng = random.Random(0)
    ids = ODD_IDS + [rng.randrange(-(2**63), 2**63) for _ in range(200)]
    for buckets in (1, 3, 7, 1000):
        assert bucket_of(torch.tensor(ids), buckets).tolist() == [bucket(i, buckets) for i in ids]
    both = Both(DynamicConfig(num_buckets=7), 7 * 64)  # room for every id: each lands in its own bucket
    slots, _ = both.step(ids)
    assert [s // both.width for s in slots] == [bucket(i, 7) for i in ids]
    assert any(bucket(i, 7) != splitmix64(i & MASK) % 7 for i in ids)  # the `>> 1` matters: a test that can fail


def test_a_batch_is_a_set_of_ids_with_summed_sightings() -> None:
    config = DynamicConfig(num_buckets=1, eviction="lfu", min_count=2)
    a, b = Both(config, 2), Both(config, 2)
    slots_a, _ = a.step([5, 6, 5, 7, 7, 7])
    slots_b, _ = b.step([7, 5, 7, 6, 7, 5])
    assert dict(zip([5, 6, 5, 7, 7, 7], slots_a, strict=True)) == dict(zip([7, 5, 7, 6, 7, 5], slots_b, strict=True))
    assert slots_a == [1, -1, 1, 0, 0, 0]  # 7 (3 sightings) before 5 (2); 6 (1) is a candidate
    assert a.stats()["misses"] == 1 and a.stats()["candidates"] == 1


def test_admission_after_min_count_sightings_in_all() -> None:
    both = Both(DynamicConfig(num_buckets=1, min_count=3), 4)
    assert both.step([42])[0] == [-1]
    assert both.step([42, 9])[0] == [-1, -1]
    assert both.step([42])[0] == [0]  # third sighting in all: a row, and it leaves the candidates
    assert both.step([9, 9])[0] == [1, 1]  # 1 + 2 sightings, in one batch
    stats = both.stats()
    assert (stats["misses"], stats["admissions"], stats["candidates"]) == (3, 2, 0)


def test_candidates_replace_the_least_recently_seen_and_every_one_lost_is_counted() -> None:
    both = Both(DynamicConfig(num_buckets=1, min_count=5, candidates_per_bucket=2), 2)
    both.step([3, 1, 2, 2])  # new candidates by most sightings, then lowest id: 2, 1 stored; 3 not stored
    assert both.stats()["dropped_candidates"] == 1
    both.step([1, 4])  # 1 seen again (kept); 4 replaces 2, the least recently seen candidate
    assert both.stats()["dropped_candidates"] == 2
    both.step([5, 1, 4])  # both entries seen this step: 5 is not stored
    assert both.stats()["dropped_candidates"] == 3
    both.step([2, 2, 2])  # 2 comes back as new (3 sightings), replacing 4 (seen as late as 1: the lowest entry)
    assert both.stats()["dropped_candidates"] == 4
    assert both.step([2])[0] == [-1]  # 3 + 1 sightings: the 2 it had before were lost with its entry
    assert both.step([2])[0] == [0]  # the fifth
    stats = both.stats()
    assert (stats["dropped_candidates"], stats["admissions"], stats["candidates"]) == (4, 1, 1)


def test_eviction_lru_lfu_free_slots_first_ties_lowest_slot() -> None:
    batches = [[2, 2, 2], [1], [3], [1]]  # one bucket of 3 slots, full: 2 (slot 0), 1 (slot 1), 3 (slot 2)
    for policy, evicted in (("lru", 0), ("lfu", 2)):  # least recently seen: 2; fewest sightings: 3
        both = Both(DynamicConfig(num_buckets=1, eviction=policy), 3)
        for batch in batches:
            both.step(batch)
        assert both.step([4])[0] == [evicted]
        assert both.stats()["evictions"] == 1
    both = Both(DynamicConfig(num_buckets=1), 2)
    both.step([10, 20])
    assert both.step([30, 5, 30])[0] == [0, 1, 0]  # 30 (twice) first; two rows last seen at once: lowest slot
    assert both.step([30, 5, 40])[0] == [0, 1, -1]  # no row free and none unseen this step: 40 misses
    assert both.stats()["misses"] == 1


def test_ttl_a_row_seen_at_s_is_kept_through_s_plus_k_and_readmitted_fresh_at_s_plus_k_plus_1() -> None:
    k, s = 3, 2
    for again in (s + k, s + k + 1):
        both = Both(DynamicConfig(num_buckets=1, ttl_steps=k), 4)
        for step in range(again + 1):
            slots, new = both.step([9] if step in (s, again) else [])
        stats = both.stats()
        if again == s + k:  # a hit: the same row, nothing new, nothing expired
            assert (slots, new, stats["expirations"], stats["admissions"]) == ([0], {}, 0, 1)
        else:  # freed at the start of s + k + 1, admitted again: the same slot, its second generation
            assert (slots, new, stats["expirations"], stats["admissions"]) == ([0], {0: 2}, 1, 2)


def test_candidates_expire_under_ttl_uncounted() -> None:
    for last, admitted in ((2, True), (3, False)):
        both = Both(DynamicConfig(num_buckets=1, min_count=2, ttl_steps=2), 4)
        both.step([7])  # a candidate at step 0
        for _ in range(1, last):
            both.step([])
        assert both.step([7])[0] == ([0] if admitted else [-1])  # step 2: kept (2 - 0 <= 2); step 3: forgotten
        stats = both.stats()
        assert (stats["dropped_candidates"], stats["expirations"]) == (0, 0)
        assert stats["candidates"] == (0 if admitted else 1)  # at step 3, 7 is a new candidate


def test_eval_reads_zeros_past_ttl_while_the_row_still_counts_in_occupancy() -> None:
    k = 2
    both = Both(DynamicConfig(num_buckets=1, ttl_steps=k), 4)
    both.step([9])  # seen at step 0
    for _ in range(k):
        both.step([])  # training steps 1 .. k: the table's step is now k + 1
        if int(both.mapper.step) <= k:
            assert both.step([9], train=False)[0] == [0]  # t - s <= k: read
    assert int(both.mapper.step) == k + 1
    assert both.step([9], train=False)[0] == [-1]  # t - s = k + 1: zeros
    assert int(both.mapper.step) == k + 1  # eval does not advance the step
    assert both.stats()["occupancy"] == 1 and both.stats()["expirations"] == 0  # still held
    assert live_slots(both.mapper)[0].numel() == 0  # serving freezes what eval reads: not live
    both.step([])  # the next training step frees it
    assert both.stats()["occupancy"] == 0 and both.stats()["expirations"] == 1


def test_eval_and_no_grad_change_nothing() -> None:
    both = Both(DynamicConfig(num_buckets=1, min_count=2, ttl_steps=1), 2)
    both.step([1, 1, 2])
    before = {k: v.clone() for k, v in both.mapper.state_dict().items()}
    for _ in range(3):
        both.step([2, 2, 3, 3, 1], train=False)
    after = both.mapper.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
