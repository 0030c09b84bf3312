"""Quantized dynamic tables: raw ids served as the float module does in eval(), within the row-wise bound."""

import pytest
import torch

from lightning_shardrec import (
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from lightning_shardrec.inference import QuantDType, QuantEmbeddingBagCollection, quantize_rows, row_error_bound
from lightning_shardrec.inference.id_map import QuantIdMap
from lightning_shardrec.modules.dynamic.hashing import bucket_of

needs_fbgemm = pytest.mark.needs_fbgemm("inference")
BACKENDS = ["torch", pytest.param("fbgemm", marks=needs_fbgemm)]
HUGE = 2**62


def _raw_ids(n: int, pool: int, gen: torch.Generator, lo: int = 0) -> torch.Tensor:
    """``n`` raw ids drawn from ``pool`` distinct ones, spread over the whole int64 range (negatives too)."""
    base = torch.randint(lo, lo + pool, (n,), generator=gen)
    return base * 7_919_000_003 - HUGE // 3 + torch.where(base % 5 == 0, HUGE, 0)


def _kjt(keys: list[str], batch: int, pool: int, gen: torch.Generator, weighted: bool, lo: int = 0
         ) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=gen)
    values = _raw_ids(int(lengths.sum()), pool, gen, lo)
    weights = torch.rand(values.numel(), generator=gen) * 2 - 0.5 if weighted else None
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths)


def _ctx(batch: int, gen: torch.Generator, weighted: bool) -> KeyedJaggedTensor:
    """One id per sample of the static table 'ctx'."""
    ids = torch.randint(0, 10, (batch,), generator=gen)
    return KeyedJaggedTensor(["c"], ids, torch.ones(batch) if weighted else None, lengths=torch.ones(batch).long())


def _trained(weighted: bool) -> tuple[EmbeddingBagCollection, torch.Generator]:
    """A collection with two small dynamic tables (LRU + ttl, LFU + min_count) and a static one,
    trained until rows were evicted and expired: 6 steps on 90 ids, 2 on 8 others (their rows
    are resident but expired at eval, step 12), 4 on 8 more."""
    tables = [
        EmbeddingBagConfig(num_embeddings=32, embedding_dim=16, name="users", feature_names=["u", "v"],
                           dynamic=DynamicConfig(eviction="lru", ttl_steps=4, num_buckets=4)),
        EmbeddingBagConfig(num_embeddings=24, embedding_dim=8, name="items", feature_names=["i"],
                           pooling=PoolingType.MEAN, dynamic=DynamicConfig(eviction="lfu", min_count=2)),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="ctx", feature_names=["c"]),
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    opt = torch.optim.SGD(ebc.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        pool, lo = (90, 0) if step < 6 else (8, 200) if step < 8 else (8, 300)
        kjt = _kjt(["u", "v", "i"], 16, pool, gen, weighted, lo)
        ctx = _ctx(16, gen, weighted)
        ebc(KeyedJaggedTensor.concat([kjt, ctx])).values().square().sum().backward()
        opt.step()
        opt.zero_grad()
    stats = ebc.dynamic_stats()
    assert stats["users"]["evictions"] > 0 and stats["users"]["expirations"] > 0 and stats["items"]["evictions"] > 0
    return ebc.eval(), gen


def _eval_kjt(gen: torch.Generator, weighted: bool) -> KeyedJaggedTensor:
    """Ids of every kind: live (bases 300-307, drawn often), expired (200-207), evicted or never seen."""
    kjt = _kjt(["u", "v", "i"], 24, 120, gen, weighted)
    choices = torch.cat([torch.arange(0, 120), torch.arange(200, 208), torch.arange(300, 308).repeat(12)])
    base = choices[torch.randint(0, choices.numel(), (kjt.values().numel(),), generator=gen)]
    values = base * 7_919_000_003 - HUGE // 3 + torch.where(base % 5 == 0, HUGE, 0)
    kjt = KeyedJaggedTensor(kjt.keys(), values, kjt.weights_or_none(), lengths=kjt.lengths())
    ctx = _ctx(24, gen, weighted)
    return KeyedJaggedTensor.concat([ctx, kjt])  # not the collection's order


def _bound(ebc: EmbeddingBagCollection, dtype: QuantDType, kjt: KeyedJaggedTensor) -> torch.Tensor:
    """Per bag ``sum |w| * bound(row)`` over its live ids (a missing id reads an exact zero), ``/ n`` for MEAN."""
    out = []
    for t in ebc.embedding_bag_configs():
        w = ebc.embedding_bags[t.name].weight.detach()
        row_bound = row_error_bound(quantize_rows(w, dtype, use_fbgemm=False), w)
        for f in t.feature_names:
            jt = kjt[f]
            ids = jt.values()
            if t.dynamic is not None:
                mapper = ebc.dynamic_tables.mapper(t.name)
                slots = mapper.lookup(ids, int(mapper.step), train=False).slots
                per_id = torch.where(slots >= 0, row_bound[slots.clamp(min=0)], 0.0)
            else:
                per_id = row_bound[ids]
            if ebc.is_weighted():
                per_id = per_id * jt.weights().abs()
            b = torch.zeros(jt.lengths().numel()).index_add_(
                0, torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths()), per_id)
            if t.pooling is PoolingType.MEAN:
                b = b / jt.lengths().clamp(min=1)
            out.append(b.unsqueeze(1).expand(-1, t.embedding_dim))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(QuantDType))
@pytest.mark.parametrize("weighted", [False, True])
def test_raw_ids_served_as_in_eval_within_bound(dtype, backend, weighted):
    ebc, gen = _trained(weighted)
    kjt = _eval_kjt(gen, weighted)
    with torch.no_grad():
        ref = ebc(kjt)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    q = QuantEmbeddingBagCollection.from_float(ebc, dtype, backend=backend)
    assert all(torch.equal(before[k], v) for k, v in ebc.state_dict().items())  # the float module is untouched
    out = q(kjt)
    assert q.backend.value == backend and out.keys() == ref.keys()
    err = (out.values() - ref.values()).abs()
    bound = _bound(ebc, dtype, kjt) + 1e-6 * ref.values().abs() + 1e-7
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # it really is quantized
    # the same bytes and mapping in a fresh collection (what load() builds) serve the same
    fresh = QuantEmbeddingBagCollection(ebc.embedding_bag_configs(), dtype, weighted, backend=backend)
    fresh.load_state_dict(q.state_dict())
    torch.testing.assert_close(fresh(kjt).values(), out.values(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_evicted_and_expired_ids_read_zeros(backend):
    ebc, gen = _trained(False)
    users = ebc.dynamic_tables.mapper("users")
    live = users.slot_ids[(users.slot_step >= 0) & (users.step - users.slot_step <= 4)]
    expired = users.slot_ids[(users.slot_step >= 0) & (users.step - users.slot_step > 4)]
    seen = _raw_ids(1000, 90, torch.Generator().manual_seed(0)).unique()
    gone = seen[~torch.isin(seen, users.slot_ids[users.slot_step >= 0])]  # evicted or expired and freed
    never = torch.tensor([1, -1, HUGE + 1, torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min])
    assert live.numel() and gone.numel() and expired.numel()
    q = QuantEmbeddingBagCollection.from_float(ebc, "int8", backend=backend)
    for dead in (gone, never, expired):
        lengths = torch.tensor([dead.numel(), 0, 0, 1, 0, 0, 0, 0])  # u, v, i, c; batch 2
        kjt = KeyedJaggedTensor(["u", "v", "i", "c"], torch.cat([dead, torch.tensor([3])]), lengths=lengths)
        out, ref = q(kjt), ebc(kjt)
        assert torch.equal(out["u"], torch.zeros(2, 16)) and torch.equal(ref["u"], torch.zeros(2, 16))
    # a MEAN bag of one live and one unknown id is half the live row (the unknown id counts in the size)
    items = ebc.dynamic_tables.mapper("items")
    one = items.slot_ids[items.slot_step >= 0][:1]
    kjt = KeyedJaggedTensor(["u", "v", "i", "c"], torch.cat([one, never[:1], torch.tensor([0])]),
                            lengths=torch.tensor([0, 0, 2, 1]))
    row = q(KeyedJaggedTensor(["u", "v", "i", "c"], torch.cat([one, torch.tensor([0])]),
                              lengths=torch.tensor([0, 0, 1, 1])))["i"]
    torch.testing.assert_close(q(kjt)["i"], row / 2)
    torch.testing.assert_close(q(kjt)["i"], ebc(kjt)["i"], rtol=0, atol=0.05)


def test_id_map_looks_up_each_id_in_its_bucket():
    top, bottom = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
    m = QuantIdMap("t", DynamicConfig(num_buckets=3), 6)  # 3 buckets of 2 slots
    ids, slots, taken = [], [], {0: 0, 1: 0, 2: 0}
    for i in [top, bottom, -7, 42, 0, 1, 2, 3]:  # each id into the next free slot of its bucket, while there is one
        b = int(bucket_of(torch.tensor([i]), 3))
        if taken[b] < 2:
            ids.append(i)
            slots.append(2 * b + taken[b])
            taken[b] += 1
    ids, slots = torch.tensor(ids), torch.tensor(slots)
    assert top in ids.tolist() and bottom in ids.tolist() and len(ids) >= 4
    m.set_live(ids, slots)
    assert torch.equal(m(ids), slots)
    assert m(torch.tensor([5, -1, 100, top - 1])).tolist() == [6, 6, 6, 6]  # not live: the zero row
    m.set_live(ids[:1], slots[:1])  # the others' slots are no longer live, though the ids match
    assert m(ids).tolist() == [int(slots[0])] + [6] * (len(ids) - 1)
    assert m(torch.empty(0, dtype=torch.long)).shape == (0,)
    zero = int(bucket_of(torch.tensor([0]), 3))  # id 0 live in the 2nd slot of its bucket, the 1st free (held 0)
    m.set_live(torch.tensor([0]), torch.tensor([2 * zero + 1]))
    assert m(torch.tensor([0, 1])).tolist() == [2 * zero + 1, 6]
    with pytest.raises(ValueError, match=r"QuantIdMap: slots must be in \[0, 6\), got"):
        m.set_live(torch.tensor([1]), torch.tensor([6]))
    with pytest.raises(ValueError, match=r"QuantIdMap: ids \(2,\) and slots \(1,\) must be \[n\] each"):
        m.set_live(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(KeyError, match=r"table 'ctx' is not dynamic; dynamic tables: \['items', 'users'\]"):
        QuantEmbeddingBagCollection.from_float(_trained(False)[0], "fp16").id_map("ctx")


def test_state_dict_keys_and_sizes():
    ebc, _ = _trained(False)
    q = QuantEmbeddingBagCollection.from_float(ebc, "int4", backend="torch")
    sd = q.state_dict()
    assert sd["embedding_bags.users.weight"].shape == (33, 8)  # capacity + the zero row, 16 dims in 8 bytes
    assert sd["id_maps.users.ids"].shape == sd["id_maps.users.live"].shape == (32,)
    assert sd["embedding_bags.ctx.weight"].shape == (10, 2) and "id_maps.ctx.ids" not in sd
    assert q.nbytes() == (33 * (8 + 4) + 32 * 9) + (25 * (4 + 4) + 24 * 9) + 10 * (2 + 4)  # rows + id maps
    # free / expired slots are stored as zeros, like the zero row
    rows = q.table("users").rows()
    dead = torch.ones(33, dtype=torch.bool)
    dead[q.id_map("users").live_rows()] = False
    deq = rows.scale[dead].float() * 0 + rows.bias[dead].float()
    assert torch.equal(deq, torch.zeros_like(deq)) and torch.equal(rows.data[dead], torch.zeros_like(rows.data[dead]))


def test_compiled_serving_lookup_equals_the_tensor_ops() -> None:
    from lightning_shardrec.inference import id_map
    from lightning_shardrec.modules.dynamic import native

    if native.native_loops() is None:
        pytest.skip("no C compiler: only the tensor ops run here")
    gen = torch.Generator().manual_seed(3)
    qmap = QuantIdMap("t", DynamicConfig(num_buckets=8), 48)  # 6 slots per bucket
    ids, used = [], [0] * 8
    for i in _raw_ids(60, 1000, gen).unique().tolist():  # each in a free slot of its bucket
        b = int(bucket_of(torch.tensor([i]), 8))
        if used[b] < 6:
            ids.append((i, b * 6 + used[b]))
            used[b] += 1
    held, slots = (torch.tensor(c) for c in zip(*ids, strict=True))
    qmap.set_live(held, slots)
    qmap.live[slots[:5]] = False  # resident but expired
    ids = held
    queries = torch.cat([ids, _raw_ids(30, 1000, gen, lo=5000), torch.tensor([0, -1, 2**63 - 1, -(2**63)])])
    compiled = qmap(queries)
    saved = id_map.native_loops
    id_map.native_loops = lambda: None  # type: ignore[assignment]
    try:
        assert torch.equal(compiled, qmap(queries))
    finally:
        id_map.native_loops = saved
    assert (compiled == 48).sum() >= 5 + 30 and (compiled < 48).sum() >= 30
