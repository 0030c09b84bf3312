"""Several dynamic tables mapped in one pass (MapperGroup), and the compiled loops against their tensor twins."""

from __future__ import annotations

import importlib.machinery
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_shardrec import DynamicConfig, EmbeddingBagConfig
from lightning_shardrec.modules import DynamicIdMapper, bucket_of, table_init
from lightning_shardrec.modules.dynamic import native
from lightning_shardrec.modules.dynamic import slots as dynamic_slots
from lightning_shardrec.modules.dynamic.layout import BUFFERS
from lightning_shardrec.modules.dynamic.mapper_group import MapperGroup, fuse_key
from lightning_shardrec.modules.dynamic.tables import fresh_rows, fresh_seeds
from tests.modules._dynamic_reference import ODD_IDS

CONFIGS = [
    DynamicConfig(),
    DynamicConfig(eviction="lfu"),
    DynamicConfig(min_count=2, candidates_per_bucket=2),
    DynamicConfig(eviction="lfu", min_count=3, ttl_steps=3),
    DynamicConfig(ttl_steps=2),
]


@contextmanager
def tensor_ops_only() -> Iterator[None]:
    """Run the tensor-op twins of the compiled loops (as on a machine without a C compiler)."""
    saved = dynamic_slots.native_loops, table_init.native_loops
    dynamic_slots.native_loops = table_init.native_loops = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        dynamic_slots.native_loops, table_init.native_loops = saved


def _mappers(config: DynamicConfig) -> list[DynamicIdMapper]:
    """Three tables of one slot layout: 5 buckets, 3 buckets (only buckets [1, 3) here), 1 bucket; 4 slots each."""
    return [
        DynamicIdMapper("a", replace(config, num_buckets=5), 20),
        DynamicIdMapper("b", replace(config, num_buckets=3), 12, bucket_range=(1, 3)),
        DynamicIdMapper("c", replace(config, num_buckets=1), 4),
    ]


def _batches(mappers: list[DynamicIdMapper], steps: int, seed: int) -> Iterator[list[torch.Tensor]]:
    """Per table, skewed drifting ids of the table's own buckets; some tables get no ids some steps."""
    rng = random.Random(seed)
    pool = [rng.choice([-1, 1]) * rng.randrange(2**63) for _ in range(300)] + ODD_IDS
    shared = pool[:40]  # the same raw ids in every table: they must stay apart
    for step in range(steps):
        live = shared + pool[40 + step * 4 : 120 + step * 4]
        batch = []
        for m in mappers:
            n = rng.randrange(0, 25)
            pick = [live[min(int(rng.paretovariate(1.0)) - 1, len(live) - 1)] for _ in range(n)]
            ids = torch.tensor(pick, dtype=torch.long)
            b = bucket_of(ids, m.num_buckets)
            batch.append(ids[(b >= m.bucket_lo) & (b < m.bucket_hi)])
        yield batch


def _state(mappers: list[DynamicIdMapper]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in mappers]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.eviction.value}-m{c.min_count}-ttl{c.ttl_steps}")
def test_group_maps_like_each_table_alone(config: DynamicConfig) -> None:
    alone, fused = _mappers(config), _mappers(config)
    group = MapperGroup(fused)
    for step, batch in enumerate(_batches(alone, 30, seed=1)):
        train = step % 7 != 6
        counts = [len(b) for b in batch]
        got = group.map(torch.cat(batch), counts, train)
        rows = got.rows.split(counts)
        new = set(zip(got.new_tables.tolist(), got.new_rows.tolist(), got.new_generations.tolist(), strict=True))
        want_new = set()
        for t, (m, ids) in enumerate(zip(alone, batch, strict=True)):
            r = m.map(ids, train)
            want = torch.where(r.slots >= 0, r.slots - m.row_offset, -1)
            assert rows[t].tolist() == want.tolist(), (step, m.table)
            pairs = zip(r.new_slots.tolist(), r.new_generations.tolist(), strict=True)
            want_new |= {(t, s - m.row_offset, g) for s, g in pairs}
        assert new == want_new, step
        assert got.new_tables.tolist() == sorted(got.new_tables.tolist())  # callers split new rows by table
    for a, f in zip(_state(alone), _state(fused), strict=True):
        assert a.keys() == f.keys() and all(torch.equal(a[k], f[k]) for k in a)
    totals = [m.stats() for m in alone]
    assert sum(s["admissions"] for s in totals) > 0
    assert sum(s["evictions"] + s["expirations"] + s["misses"] for s in totals) > 0


def test_compiled_loops_equal_their_tensor_twins() -> None:
    if native.native_loops() is None:
        pytest.skip("no C compiler: only the tensor ops run here")
    for config in CONFIGS:
        runs = []
        for compiled in (True, False):
            mappers = _mappers(config)
            group = MapperGroup(mappers)
            outs = []
            with tensor_ops_only() if not compiled else _nothing():
                for step, batch in enumerate(_batches(mappers, 25, seed=7)):
                    r = group.map(torch.cat(batch), [len(b) for b in batch], step % 5 != 4)
                    outs.append([r.rows.tolist(), r.new_rows.tolist(), r.new_generations.tolist()])
                    outs.append(mappers[0].lookup(torch.tensor(ODD_IDS), step, False).slots.tolist())
            runs.append((outs, _state(mappers)))
        (out_c, state_c), (out_t, state_t) = runs
        assert out_c == out_t
        assert all(torch.equal(a[k], b[k]) for a, b in zip(state_c, state_t, strict=True) for k in a)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_uniform_rows_equal_tensor_ops_bit_for_bit(dtype: torch.dtype) -> None:
    """CPU init (numpy's uint64 passes) against the tensor ops that CUDA runs, on the same seeds."""
    seeds = torch.tensor(ODD_IDS * 40)
    lows = torch.linspace(-1, 0, len(seeds), dtype=torch.float64)
    for args in ((seeds, 0, 64, (-0.0022, 0.0022), dtype), (seeds, 0, 9, (lows, lows + 0.5), dtype),
                 (seeds, 7, 5, None, torch.float64)):  # fmt: skip
        assert torch.equal(table_init._uniform_rows(*args), table_init._uniform_torch(*args))
    table = EmbeddingBagConfig(name="t", embedding_dim=24, num_embeddings=3000, feature_names=["f"])
    whole, again = torch.empty(3000, 24, dtype=dtype), torch.empty(3000, 24, dtype=dtype)
    table_init.init_block(table, 5, whole)
    table_init._init_torch(5, *table.init_range(), again, 0, 0)
    assert torch.equal(whole, again)
    block = torch.empty(24, 100, dtype=dtype).t()  # a strided block of rows [2000, 2100) x columns [7, 31)
    table_init.init_block(table, 5, block, 2000, 7)
    assert torch.equal(block[:, :17], whole[2000:2100, 7:])


@pytest.mark.parametrize("compiled", [True, False])
def test_fresh_rows_of_several_tables_written_in_place_equal_each_tables_fresh_rows(compiled: bool) -> None:
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=r, feature_names=[n], dynamic=DynamicConfig(seed=s))
        for n, r, s in (("u", 64, 0), ("v", 640, 3), ("w", 16, 0))
    ]
    which = torch.tensor([2, 0, 0, 1, 2, 1])
    slots, gens = torch.tensor([3, 9, 10, 600, 0, 5]), torch.tensor([1, 1, 4, 2, 7, 1])
    fresh = fresh_seeds(tables, which, slots, gens)
    assert fresh is not None
    weight = torch.zeros(12, 8)
    rows = torch.tensor([11, 0, 5, 6, 2, 9])
    with tensor_ops_only() if not compiled else _nothing():
        table_init.write_uniform_rows(weight, rows, *fresh)
    for i in range(len(which)):
        want = fresh_rows(tables[int(which[i])], slots[i : i + 1], gens[i : i + 1], weight)
        assert torch.equal(weight[rows[i]], want[0])
    assert weight[[1, 3, 4, 7, 8, 10]].eq(0).all()  # no other row written
    custom = EmbeddingBagConfig(name="x", embedding_dim=8, num_embeddings=8, feature_names=["x"],
                                init_fn=torch.nn.init.ones_, dynamic=DynamicConfig())  # fmt: skip
    assert fresh_seeds([custom], which[:1] * 0, slots[:1], gens[:1]) is None


def test_an_id_placed_again_lands_before_its_dead_copies() -> None:
    """What the one-check find relies on: in a bucket, the first entry holding an id is its live one."""
    config = DynamicConfig(num_buckets=2, eviction="lfu", min_count=2, ttl_steps=2, candidates_per_bucket=3)
    mapper = DynamicIdMapper("t", config, 8)
    rng = random.Random(3)
    pool = [rng.randrange(-50, 50) for _ in range(30)]
    dead_copies = 0
    for step in range(300):
        mapper.lookup(torch.tensor([rng.choice(pool[: 5 + step % 25]) for _ in range(rng.randrange(0, 9))]), step, True)
        for held, last, width in ((mapper.slot_ids, mapper.slot_step, 4), (mapper.cand_ids, mapper.cand_step, 3)):
            for row_ids, row_last in zip(held.view(-1, width).tolist(), last.view(-1, width).tolist(), strict=True):
                for j, (i, s) in enumerate(zip(row_ids, row_last, strict=True)):
                    if s >= 0:
                        assert row_ids.index(i) == j, (step, row_ids, row_last)
                    else:
                        dead_copies += any(k == i and t >= 0 for k, t in zip(row_ids, row_last, strict=True))
    assert dead_copies > 0  # the case occurred: a dead copy beside the live one


def test_group_rebinds_replaced_buffers_and_saves_plain_tensors() -> None:
    config = DynamicConfig()
    mappers = _mappers(config)
    group = MapperGroup(mappers)
    batches = list(_batches(mappers, 6, seed=2))
    for batch in batches[:3]:
        group.map(torch.cat(batch), [len(b) for b in batch], True)
    saved = mappers[1].state_dict()
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in saved.values())  # no flat storage in a save
    twin = _mappers(config)
    for m, t in zip(mappers, twin, strict=True):
        t.load_state_dict(m.state_dict())
    mappers[0].load_state_dict({k: v.clone() for k, v in mappers[0].state_dict().items()}, assign=True)
    for batch in batches[3:]:
        got = group.map(torch.cat(batch), [len(b) for b in batch], True)
        for t, (m, ids, rows) in enumerate(zip(twin, batch, got.rows.split([len(b) for b in batch]), strict=True)):
            r = m.map(ids, True)
            assert rows.tolist() == torch.where(r.slots >= 0, r.slots - m.row_offset, -1).tolist(), t
    assert all(mappers[0]._buffers[b] is not None for b in BUFFERS)
    assert int(mappers[0].step) == 6


def test_group_names_the_table_an_id_does_not_belong_to() -> None:
    mappers = _mappers(DynamicConfig())
    group = MapperGroup(mappers)
    ids = torch.arange(40)
    stray = ids[bucket_of(ids, 3) == 0][:1]  # table b holds only buckets [1, 3)
    for compiled in (True, False):
        match = r"dynamic table 'b': ids outside buckets \[1, 3\) were sent"
        with tensor_ops_only() if not compiled else _nothing(), pytest.raises(ValueError, match=match):
            group.map(torch.cat([ids[:3], stray]), [3, 1, 0], True)


def test_mappers_of_other_layouts_do_not_fuse() -> None:
    a, b = DynamicIdMapper("a", DynamicConfig(), 16), DynamicIdMapper("b", DynamicConfig(eviction="lfu"), 16)
    assert fuse_key(a) != fuse_key(b)
    with pytest.raises(ValueError, match="one slot layout and policy"):
        MapperGroup([a, b])


def test_without_the_compiled_loops_the_tensor_ops_run_after_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    native.native_loops.cache_clear()
    monkeypatch.setattr(native, "library_path", lambda folder=None: None)  # a package installed without them
    try:
        with pytest.warns(
            UserWarning,
            match=r"the package was installed without its compiled loops \(no _loops\.\* beside native\.c\), so its "
            r"id mapping and fresh rows run as tensor ops, .* \(static tables are not affected\)",
        ):
            assert native.native_loops() is None
        mapper = DynamicIdMapper("t", DynamicConfig(), 16)
        assert mapper.lookup(torch.tensor(ODD_IDS), 0, True).slots.ge(0).all()
        monkeypatch.setenv(native.NATIVE_ENV, "0")
        native.native_loops.cache_clear()
        assert native.native_loops() is None  # silenced: no warning (pytest turns warnings into records only)
    finally:
        native.native_loops.cache_clear()


def test_compiled_loops_that_do_not_load_fall_back_to_tensor_ops_after_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "_loops.so"
    broken.write_bytes(b"not a shared library")  # another machine's build, a truncated copy
    native.native_loops.cache_clear()
    monkeypatch.setattr(native, "library_path", lambda folder=None: broken)
    try:
        with pytest.warns(UserWarning, match=r"loading the compiled loops .*_loops\.so failed \(.*\); dynamic tables'"):
            assert native.native_loops() is None
    finally:
        native.native_loops.cache_clear()


def test_the_compiled_loops_are_found_beside_their_source_by_this_interpreters_suffix(tmp_path: Path) -> None:
    built = native.library_path()
    assert built is not None and built.parent == native.SOURCE.parent and built.name.startswith("_loops.")
    assert native.library_path(tmp_path) is None
    (tmp_path / f"_loops{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(built.read_bytes())
    assert native.load(native.library_path(tmp_path)).serve is not None  # type: ignore[arg-type]


def test_a_library_built_from_another_native_c_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale build (its functions may take other arguments) is never called: one warning, the tensor ops."""
    built = native.library_path()
    assert built is not None
    monkeypatch.setattr(native, "source_key", lambda: "0123456789abcdef")
    native.native_loops.cache_clear()
    try:
        with pytest.warns(
            UserWarning, match=r"it was built from another native\.c \(source [0-9a-f]{16}, this one is "
        ):
            assert native.native_loops() is None
    finally:
        native.native_loops.cache_clear()
