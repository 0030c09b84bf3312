"""A dynamic table's window (lookups, misses, distinct ids since the last new_window) and the full-table warning."""

from __future__ import annotations

import pickle
import re

import torch

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.distributed.sharded.dynamic_stats import dynamic_stats, full_table_warnings
from lightning_shardrec.modules.dynamic.stats import saved_figures, suggested_capacity


def _ebc(rows: int, min_count: int = 2, num_buckets: int | None = None) -> EmbeddingBagCollection:
    config = DynamicConfig(min_count=min_count, num_buckets=num_buckets)
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=rows, feature_names=["u"], dynamic=config)]
    )


def _feed(ebc: EmbeddingBagCollection, distinct: int, steps: int, per_step: int = 256) -> tuple[int, int]:
    """``steps`` training lookups of ``per_step`` ids drawn from ``distinct`` raw ids:
    ``(ids looked up, distinct ids among them)``."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randint(-(2**62), 2**62, (distinct,), generator=gen)
    seen = []
    for _ in range(steps):
        ids = pool[torch.randint(0, distinct, (per_step,), generator=gen)]
        ebc(KeyedJaggedTensor(["u"], ids, lengths=torch.tensor([per_step])))
        seen.append(ids)
    return steps * per_step, torch.cat(seen).unique().numel()


def test_window_counts_lookups_misses_and_distinct_ids():
    ebc = _ebc(256)
    looked_up, seen = _feed(ebc, distinct=2000, steps=20)
    s = dynamic_stats(ebc)["user"]
    assert s["window_lookups"] == looked_up and s["window_misses"] == s["misses"] > looked_up // 2
    assert s["miss_rate"] == s["window_misses"] / looked_up
    assert abs(s["window_ids"] - seen) < 0.1 * seen  # linear-counting estimate
    assert s["suggested_capacity"] == -(-s["window_ids"] // 16) * 16  # no num_buckets: a multiple of 16
    assert "user" in dynamic_stats(ebc, new_window=True)  # gathers, then starts a new window
    after = ebc.dynamic_stats()["user"]
    assert (after["window_lookups"], after["window_misses"], after["window_ids"], after["miss_rate"]) == (0, 0, 0, 0.0)
    assert after["misses"] == s["misses"] and after["suggested_capacity"] == 256  # cumulative kept; never below


def test_full_table_warning_text_and_threshold():
    ebc = _ebc(256)
    _feed(ebc, distinct=2000, steps=20)
    stats = dynamic_stats(ebc)
    s = stats["user"]
    (message,) = full_table_warnings(stats, 0.1, steps=20)
    expected = (
        rf"dynamic table 'user' is full: {s['window_misses']} of its {s['window_lookups']} lookups over the last "
        rf"20 steps missed \(miss rate {100 * s['miss_rate']:.1f}%, threshold 10%\); capacity 256, occupancy "
        rf"{s['occupancy']} \(\d+%\)\. The window saw about {s['window_ids']} distinct ids: "
        rf"num_embeddings={s['suggested_capacity']} would have held them"
    )
    assert re.fullmatch(expected + r" \(docs/dynamic-tables\.md, 'A full table'\)", message)
    assert full_table_warnings(stats, s["miss_rate"]) == []  # at the threshold: no warning (strictly above warns)
    assert len(full_table_warnings(stats, s["miss_rate"] - 0.01)) == 1


def test_no_warning_for_a_table_that_holds_its_ids():
    ebc = _ebc(4096, min_count=1)
    _feed(ebc, distinct=500, steps=10)
    stats = dynamic_stats(ebc)
    assert stats["user"]["window_misses"] == 0 and stats["user"]["miss_rate"] == 0.0
    assert full_table_warnings(stats, 0.1) == [] and stats["user"]["suggested_capacity"] == 4096
    assert full_table_warnings(dynamic_stats(_ebc(64)), 0.1) == []  # no lookups yet: no rate, no warning


def test_suggested_capacity_rounds_to_the_bucket_count():
    config = EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=60, feature_names=["f"], dynamic=DynamicConfig(num_buckets=6)
    )
    assert suggested_capacity(config, 100) == 102  # a multiple of 6 buckets
    assert suggested_capacity(config, 10) == 60  # never below the table
    ebc = _ebc(60, num_buckets=6)
    _feed(ebc, distinct=600, steps=5, per_step=200)
    s = ebc.dynamic_stats()["user"]
    assert s["suggested_capacity"] % 6 == 0 and s["suggested_capacity"] >= s["window_ids"] > 60


def test_the_window_is_not_saved_so_checkpoints_keep_their_layout():
    ebc = _ebc(256)
    _feed(ebc, distinct=2000, steps=5)
    state = ebc.state_dict()
    assert not any("window" in k for k in state)  # old checkpoints hold exactly these keys
    resumed = _ebc(256)
    resumed.load_state_dict(state)  # strict
    assert saved_figures(resumed.dynamic_stats()) == saved_figures(ebc.dynamic_stats())
    assert resumed.dynamic_stats()["user"]["window_lookups"] == 0 < ebc.dynamic_stats()["user"]["window_lookups"]


def test_a_mapper_pickled_before_the_window_existed_gets_an_empty_one():
    mapper = _ebc(64).dynamic_tables.mapper("user")
    del mapper._buffers["window"], mapper._buffers["window_ids"]  # as pickled by an older version
    loaded = pickle.loads(pickle.dumps(mapper))
    loaded.map(torch.tensor([5, 7, 5]), True)
    assert loaded.window.tolist() == [3, 1]  # 7 missed (min_count 2; 5 was seen twice)
    assert int(loaded.window_figures()[2]) == 2  # 2 distinct ids
