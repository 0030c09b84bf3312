"""Seeded, block-independent table init: any block of a table, initialised on its own, equals
the same rows and columns of the whole table; a table's init takes one number from the
global RNG whether it is built on a real device or on meta."""

from __future__ import annotations

import zlib

import pytest
import torch

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from lightning_shardrec.modules.dynamic.hashing import mix64
from lightning_shardrec.modules.table_init import init_block, mix64_, table_device, tables_on_meta, unit_uniform


def bag_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=97, embedding_dim=12, name="a", feature_names=["f"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=3, name="b", weight_init_min=0.0, weight_init_max=2.0),
    ]


BLOCKS = [  # (r0, c0, rows, cols): row-wise, column-wise, grid, single row / column, the whole table
    (0, 0, 97, 12),
    (0, 0, 40, 12),
    (40, 0, 57, 12),
    (0, 4, 97, 8),
    (33, 8, 20, 4),
    (96, 11, 1, 1),
    (1, 0, 1, 12),
]


@pytest.mark.parametrize(("r0", "c0", "rows", "cols"), BLOCKS)
def test_a_block_alone_equals_the_same_block_of_the_whole_table(r0: int, c0: int, rows: int, cols: int) -> None:
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(bag_tables())
    full = ebc.embedding_bags["a"].weight.detach()
    block = torch.empty(rows, cols)
    init_block(ebc.embedding_bag_configs()[0], ebc.init_seed("a"), block, r0, c0)
    assert torch.equal(block, full[r0 : r0 + rows, c0 : c0 + cols])
    half = torch.empty(rows, cols, dtype=torch.float16)  # a half-precision shard: the fp32 table's values, rounded
    init_block(ebc.embedding_bag_configs()[0], ebc.init_seed("a"), half, r0, c0)
    assert torch.equal(half, full[r0 : r0 + rows, c0 : c0 + cols].half())


def test_blocks_larger_than_one_hash_block_tile_the_table() -> None:
    """Rows cut at any point (here not at the internal block size) give the same table."""
    config = EmbeddingConfig(num_embeddings=3000, embedding_dim=64, name="t")
    whole = torch.empty(3000, 64)
    init_block(config, 11, whole)
    parts = [torch.empty(b - a, 64) for a, b in ((0, 777), (777, 2049), (2049, 3000))]
    for (a, _), p in zip(((0, 777), (777, 2049), (2049, 3000)), parts, strict=True):
        init_block(config, 11, p, a)
    assert torch.equal(torch.cat(parts), whole)


def test_values_are_uniform_in_the_range_and_differ_by_seed_and_table() -> None:
    config = EmbeddingBagConfig(num_embeddings=400, embedding_dim=50, name="t")
    lo, hi = config.init_range()
    w = torch.empty(400, 50)
    init_block(config, 1, w)
    assert lo <= w.min() and w.max() <= hi
    assert abs(w.mean().item()) < 0.02 * hi  # uniform: mean 0, std (hi - lo) / sqrt(12)
    assert w.std().item() == pytest.approx((hi - lo) / 12**0.5, rel=0.02)
    other = torch.empty(400, 50)
    init_block(config, 2, other)
    assert not torch.equal(w, other)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(bag_tables())
    assert ebc.init_seed("a") != ebc.init_seed("b")


def test_a_column_hashes_alike_whatever_block_it_starts() -> None:
    seeds = torch.tensor([5, -9, 2**40])
    unit = unit_uniform(seeds, 2, 4)
    assert unit.shape == (3, 4) and bool(((unit >= 0) & (unit < 1)).all())
    assert torch.equal(unit, unit_uniform(seeds, 0, 6)[:, 2:])


@pytest.mark.parametrize("where", ["cpu", "meta", "context"])
@pytest.mark.parametrize("kind", ["bag", "sequence"])
def test_building_a_collection_leaves_the_global_rng_alone_wherever_it_is_built(where: str, kind: str) -> None:
    # TorchRec draws nothing on meta: a dense layer built after the tables initialises as under TorchRec
    def build() -> torch.nn.Module:
        tables = bag_tables() if kind == "bag" else [EmbeddingConfig(**_fields(t)) for t in bag_tables()]
        cls = EmbeddingBagCollection if kind == "bag" else EmbeddingCollection
        if where == "context":
            with tables_on_meta():
                return cls(tables)
        return cls(tables, device=where)

    torch.manual_seed(7)
    coll = build()
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))  # the dense layers built next see the same numbers
    torch.manual_seed(7)
    draws = [int(torch.randint(0, 2**62, (1,)).item()) for _ in range(2)]
    seeds = [(d ^ (zlib.crc32(n.encode()) * 0x9E3779B97F4A7C15)) % 2**62 for n, d in zip("ab", draws, strict=True)]
    assert [coll.init_seed(n) for n in ("a", "b")] == seeds  # the next draws, read from a fork, mixed with the name
    weights = [p.device.type for p in coll.parameters()]
    assert weights == (["cpu", "cpu"] if where == "cpu" else ["meta", "meta"])


def _fields(t: EmbeddingBagConfig) -> dict:
    return {
        "num_embeddings": t.num_embeddings,
        "embedding_dim": t.embedding_dim,
        "name": t.name,
        "feature_names": t.feature_names,
        "weight_init_min": t.weight_init_min,
        "weight_init_max": t.weight_init_max,
    }


def test_tables_on_meta_only_moves_collections_without_a_device() -> None:
    assert table_device(None) is None
    with tables_on_meta():
        assert table_device(None) == "meta"
        assert table_device("cpu") == "cpu"  # an explicit device is kept
        ebc = EmbeddingBagCollection(bag_tables(), device="cpu")
        dense = torch.nn.Linear(2, 2)
    assert {p.device.type for p in ebc.parameters()} == {"cpu"}
    assert dense.weight.device.type == "cpu"  # only the tables: torch modules are untouched
    assert table_device(None) is None


def test_reset_parameters_restores_the_initial_rows() -> None:
    ebc = EmbeddingBagCollection(bag_tables())
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    with torch.no_grad():
        for p in ebc.parameters():
            p.fill_(0.5)
    ebc.reset_parameters()
    for k, v in ebc.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_custom_init_fn_runs_on_the_whole_table_from_the_seed() -> None:
    config = EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t", init_fn=lambda w: w.normal_())
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection([config])
    after = torch.rand(2)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(2))  # the init_fn drew from a forked, seeded RNG; no seed draw either
    whole = torch.empty(30, 4)
    init_block(config, ebc.init_seed("t"), whole)
    assert torch.equal(whole, ebc.embedding_bags["t"].weight.detach())  # a table-wise shard built on meta
    part = torch.empty(10, 4)
    init_block(config, ebc.init_seed("t"), part, 10)
    again = torch.empty(10, 4)
    init_block(config, ebc.init_seed("t"), again, 10)
    assert torch.equal(part, again)  # deterministic, but (documented) not the whole table's rows 10..19
    assert not torch.equal(part, whole[10:20])


def test_the_in_place_mix_is_mix64() -> None:
    x = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789])
    assert torch.equal(mix64_(x.clone(), torch.empty_like(x)), mix64(x))


class _TwoTowers(torch.nn.Module):
    """Two collections with a same-named table, back to back (no draw between), as a TorchRec two-tower model."""

    def __init__(self, kind: str, device: str) -> None:
        super().__init__()
        self.query, self.item = (_collection(kind, device) for _ in range(2))
        self.dense = torch.nn.Linear(2, 2)


def _collection(kind: str, device: str) -> torch.nn.Module:
    if kind == "bag":
        return EmbeddingBagCollection(bag_tables(), device=device)
    return EmbeddingCollection([EmbeddingConfig(**_fields(t)) for t in bag_tables()], device=device)


@pytest.mark.parametrize("kind", ["bag", "sequence"])
def test_same_named_tables_of_one_model_start_different_and_the_model_rebuilds_equal(kind: str) -> None:
    # TorchRec 1.8 draws the rows from the global stream in construction order: model.query's table "a"
    # and model.item's table "a" differ; the same model built again after the same seed is equal
    torch.manual_seed(3)
    model = _TwoTowers(kind, "cpu")
    rows = {n: p.detach().clone() for n, p in model.named_parameters()}
    query_a = next(v for n, v in rows.items() if n.startswith("query.") and ".a." in n)
    item_a = next(v for n, v in rows.items() if n.startswith("item.") and ".a." in n)
    assert not torch.equal(query_a, item_a)
    assert model.query.init_seed("a") != model.item.init_seed("a")
    torch.manual_seed(3)
    again = _TwoTowers(kind, "cpu")
    assert all(torch.equal(p, rows[n]) for n, p in again.named_parameters())
    torch.manual_seed(3)
    on_meta = _TwoTowers(kind, "meta")  # a sharded run builds on meta: the same seeds, the same dense init
    for coll in ("query", "item"):
        seeds = [getattr(m, coll).init_seed(n) for m in (model, on_meta) for n in ("a", "b")]
        assert seeds[:2] == seeds[2:]
    assert torch.equal(on_meta.dense.weight, model.dense.weight)  # the tables drew nothing from the stream
    torch.manual_seed(3)
    alone = _collection(kind, "cpu")  # the first of a name under construction keeps the seed it had alone
    assert alone.init_seed("a") == model.query.init_seed("a")
