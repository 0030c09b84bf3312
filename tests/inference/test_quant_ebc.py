"""QuantEmbeddingBagCollection: pooled error within the row-wise bound, both backends agree."""

import pytest
import torch
import torch.nn.functional as F

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType, _fbgemm
from lightning_shardrec.inference import (
    QuantBackend,
    QuantDType,
    QuantEmbeddingBagCollection,
    quantize,
    quantize_rows,
    row_error_bound,
)

needs_fbgemm = pytest.mark.needs_fbgemm("inference")
BACKENDS = [QuantBackend.TORCH, pytest.param(QuantBackend.FBGEMM, marks=needs_fbgemm)]


def _ebc(weighted: bool) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=300, embedding_dim=16, name="big", feature_names=["u", "v"]),
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name="mean", feature_names=["m"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="tiny", feature_names=["t"]),
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    with torch.no_grad():  # trained-looking rows: different magnitudes per row
        for bag in ebc.embedding_bags.values():
            bag.weight.mul_(torch.logspace(-2, 1, bag.weight.shape[0]).unsqueeze(1))
    return ebc


def _kjt(ebc: EmbeddingBagCollection, batch: int = 32, weighted: bool = False) -> KeyedJaggedTensor:
    rows = {f: t.num_embeddings for t in ebc.embedding_bag_configs() for f in t.feature_names}
    keys = ["t", "m", "v", "u"]  # not the collection's order: forward must rearrange
    lengths = torch.randint(0, 6, (len(keys) * batch,))
    lengths[0] = 0
    values = torch.cat([torch.randint(0, rows[k], (int(lengths[i * batch:(i + 1) * batch].sum()),))
                        for i, k in enumerate(keys)])
    weights = torch.rand(values.numel()) * 2 - 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _pooled_bound(ebc: EmbeddingBagCollection, dtype: QuantDType, kjt: KeyedJaggedTensor) -> torch.Tensor:
    """Per bag ``sum |w_i| * bound(row_i)`` (``/ n`` under MEAN): ``[B, sum dims]``."""
    per_feature = []
    for t in ebc.embedding_bag_configs():
        w = ebc.embedding_bags[t.name].weight
        row_bound = row_error_bound(quantize_rows(w, dtype, use_fbgemm=False), w).unsqueeze(1)
        for f in t.feature_names:
            jt = kjt[f]
            psw = jt.weights().abs() if ebc.is_weighted() else None
            b = F.embedding_bag(jt.values(), row_bound, jt.offsets(), mode="sum", per_sample_weights=psw,
                                include_last_offset=True)
            if t.pooling is PoolingType.MEAN:
                b = b / jt.lengths().clamp(min=1).unsqueeze(1)
            per_feature.append(b.expand(-1, t.embedding_dim))
    return torch.cat(per_feature, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(QuantDType))
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_error_within_rowwise_bound(dtype, backend, weighted):
    ebc = _ebc(weighted)
    kjt = _kjt(ebc, weighted=weighted)
    with torch.no_grad():
        ref = ebc(kjt)
    q = QuantEmbeddingBagCollection.from_float(ebc, dtype, backend=backend)
    out = q(kjt)
    assert q.backend is backend
    assert out.keys() == ref.keys() == ["u", "v", "m", "t"] and out.length_per_key() == ref.length_per_key()
    err = (out.values() - ref.values()).abs()
    bound = _pooled_bound(ebc, dtype, kjt) + 1e-6 * ref.values().abs() + 1e-7  # fp32 summation order
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # it really is quantized


@needs_fbgemm
@pytest.mark.parametrize("dtype", list(QuantDType))
@pytest.mark.parametrize("weighted", [False, True])
def test_backends_agree_on_the_same_rows(dtype, weighted):
    ebc = _ebc(weighted)
    kjt = _kjt(ebc, weighted=weighted)
    q = QuantEmbeddingBagCollection.from_float(ebc, dtype, backend="fbgemm")
    fb = q(kjt).values()
    q.set_backend("torch")  # the same bytes (now the TBE's storage), read by the torch kernel
    torch.testing.assert_close(q(kjt).values(), fb, rtol=1e-6, atol=1e-6)


@needs_fbgemm
def test_fbgemm_keeps_one_copy_and_state_dict_writes_through():
    ebc = _ebc(False)
    kjt = _kjt(ebc)
    q = QuantEmbeddingBagCollection.from_float(ebc, "int4", backend="fbgemm")
    before = q(kjt).values()
    tbe_storage = q._lookup.tbe.weights_host.untyped_storage().data_ptr()
    assert all(b.untyped_storage().data_ptr() == tbe_storage for b in q.buffers())
    assert sorted(q.state_dict()) == sorted(
        f"embedding_bags.{t}.{s}" for t in ("big", "mean", "tiny") for s in ("weight", "weight_qscale", "weight_qbias"))
    other = QuantEmbeddingBagCollection.from_float(_ebc(False), "int4", backend="torch")
    q.load_state_dict(other.state_dict())
    torch.testing.assert_close(q(kjt).values(), other(kjt).values(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(q(kjt).values(), before)


def test_quantize_swaps_nested_collections_and_sizes():
    model = torch.nn.ModuleDict({"sparse": _ebc(False), "top": torch.nn.Linear(4, 1)})
    fp32 = sum(b.weight.numel() * 4 for b in model["sparse"].embedding_bags.values())
    q = quantize(model, "int8", inplace=False)
    assert isinstance(model["sparse"], EmbeddingBagCollection)  # inplace=False left it alone
    assert isinstance(q["sparse"], QuantEmbeddingBagCollection) and isinstance(q["top"], torch.nn.Linear)
    assert q["sparse"].nbytes() == sum(n * (d + 4) for n, d in [(300, 16), (40, 8), (5, 4)])
    assert q["sparse"].nbytes() / fp32 < 0.32
    dq = quantize(model, "int4", dense=True)
    assert type(dq["top"]).__name__ == "Linear" and "quantized" in type(dq["top"]).__module__


def test_dim_not_packable_names_tables():
    t = EmbeddingBagConfig(num_embeddings=4, embedding_dim=6, name="odd", feature_names=["f"])
    with pytest.raises(ValueError, match=r"int4 needs embedding_dim a multiple of 4 .* tables: 'odd' dim 6"):
        QuantEmbeddingBagCollection([t], "int4")
    QuantEmbeddingBagCollection([t], "int8")  # 6 bytes + 4: aligned


def test_weighted_needs_weights_and_ids_are_checked():
    q = QuantEmbeddingBagCollection.from_float(_ebc(True), "int8")
    with pytest.raises(ValueError, match=r"is_weighted=True\) got a KeyedJaggedTensor without weights"):
        q(_kjt(q, weighted=False))
    kjt = KeyedJaggedTensor(keys=["u", "v", "m", "t"], values=torch.tensor([0, 1, 2, 9]),
                            lengths=torch.tensor([1, 1, 1, 1]), weights=torch.ones(4))
    with pytest.raises(ValueError, match=r"feature 't' \(table 'tiny'\): id 9 outside \[0, 5\)"):
        q(kjt)


def test_backend_choice_errors_and_env_override(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown quantized lookup backend 'cuda'; available: auto, fbgemm, torch"):
        QuantBackend.parse("cuda")
    monkeypatch.setenv("LIGHTNING_SHARDREC_DISABLE_FBGEMM", "1")
    _fbgemm._load.cache_clear()
    _fbgemm._load_inference.cache_clear()
    try:
        assert QuantBackend.AUTO.resolve(torch.device("cpu")) is QuantBackend.TORCH
        with pytest.raises(ValueError, match=r"backend='fbgemm' needs fbgemm_gpu's CPU inference TBE"):
            QuantBackend.FBGEMM.resolve(torch.device("cpu"))
    finally:
        monkeypatch.delenv("LIGHTNING_SHARDREC_DISABLE_FBGEMM")
        _fbgemm._load.cache_clear()
        _fbgemm._load_inference.cache_clear()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vbe_and_shared_features_match_the_expanded_batch(backend):
    tables = [
        EmbeddingBagConfig(num_embeddings=50, embedding_dim=8, name="a", feature_names=["u", "v"]),
        EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="b", feature_names=["u"]),  # u@a, u@b
    ]
    q = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(tables), QuantDType.INT8, backend=backend)
    # u: 1 bag for 3 samples; v: 3 bags
    vbe = KeyedJaggedTensor(
        ["u", "v"], torch.tensor([4, 9, 1, 2, 3]), lengths=torch.tensor([2, 1, 0, 2]),
        stride_per_key_per_rank=[[1], [3]], inverse_indices=(["u", "v"], torch.tensor([[0, 0, 0], [0, 1, 2]])),
    )
    dense = KeyedJaggedTensor(["u", "v"], torch.tensor([4, 9, 4, 9, 4, 9, 1, 2, 3]),
                              lengths=torch.tensor([2, 2, 2, 1, 0, 2]))
    got, want = q(vbe), q(dense)
    assert got.keys() == ["u@a", "v", "u@b"] == want.keys()
    torch.testing.assert_close(got.values(), want.values())
