"""QuantEmbeddingCollection: each id's row within the row-wise bound, exactly the dequantized stored row,
TorchRec's state-dict layout, ``need_indices``, and named refusals."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_shardrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from lightning_shardrec.configs import DynamicConfig
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.inference import (
    QuantDType,
    QuantEmbeddingCollection,
    dequantize_rows,
    quantize_rows,
    row_error_bound,
)


def _ec(need_indices: bool = False) -> EmbeddingCollection:
    tables = [
        EmbeddingConfig(num_embeddings=50, embedding_dim=16, name="items", feature_names=["seen", "liked"]),
        EmbeddingConfig(num_embeddings=7, embedding_dim=16, name="kinds", feature_names=["kind"]),
    ]
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables, need_indices=need_indices)
    with torch.no_grad():  # trained-looking rows: different magnitudes per row
        for emb in ec.embeddings.values():
            emb.weight.mul_(torch.logspace(-2, 1, emb.weight.shape[0]).unsqueeze(1))
    return ec


def _kjt() -> KeyedJaggedTensor:
    keys = ["kind", "liked", "seen"]  # not the collection's order: forward rearranges
    lengths = torch.tensor([1, 0, 2, 3, 1, 0, 4, 2, 2])
    rows = {"kind": 7, "liked": 50, "seen": 50}
    values = torch.cat(
        [torch.randint(0, rows[k], (int(lengths[3 * i : 3 * i + 3].sum()),)) for i, k in enumerate(keys)]
    )
    return KeyedJaggedTensor(keys, values, lengths=lengths)


@pytest.mark.parametrize("dtype", list(QuantDType))
def test_each_id_reads_its_dequantized_row_within_the_bound(dtype: QuantDType) -> None:
    ec, kjt = _ec(need_indices=True), _kjt()
    q = QuantEmbeddingCollection.from_float(ec, dtype)
    want, got = ec(kjt), q(kjt)
    assert list(got) == list(want) == ["seen", "liked", "kind"]
    for table in ec.embedding_configs():
        w = ec.embeddings[table.name].weight.detach()
        stored = quantize_rows(w, dtype)
        bound = row_error_bound(stored, w)
        for f in table.feature_names:
            ids = kjt[f].values()
            scale, bias = (None if t is None else t[ids] for t in (stored.scale, stored.bias))
            exact = dequantize_rows(dtype, stored.data[ids], scale, bias)
            assert torch.equal(got[f].values(), exact)
            assert ((got[f].values() - want[f].values()).abs() <= bound[ids].unsqueeze(1)).all()
            assert torch.equal(got[f].lengths(), kjt[f].lengths()) and torch.equal(got[f].weights(), ids)


def test_state_dict_has_torchrecs_layout_and_loads_into_empty_rows() -> None:
    ec, kjt = _ec(), _kjt()
    q = QuantEmbeddingCollection.from_float(ec, "int4")
    state = q.state_dict()
    buffers = ("weight", "weight_qbias", "weight_qscale")
    assert sorted(state) == [f"embeddings.{t}.{b}" for t in ("items", "kinds") for b in buffers]
    assert state["embeddings.items.weight"].dtype == torch.uint8 and state["embeddings.items.weight"].shape == (50, 8)
    empty = QuantEmbeddingCollection(ec.embedding_configs(), "int4")
    empty.load_state_dict(state)
    for f, jt in q(kjt).items():
        assert torch.equal(empty(kjt)[f].values(), jt.values())
    assert q.nbytes() == sum(t.numel() * t.element_size() for t in state.values())


def test_refusals_name_the_table_and_the_value() -> None:
    ec = _ec()
    with pytest.raises(ValueError, match=re.escape("feature 'seen' (table 'items'): id 50 outside [0, 50)")):
        bad = KeyedJaggedTensor(["seen", "liked", "kind"], torch.tensor([50, 0, 0]), lengths=torch.tensor([1, 1, 1]))
        QuantEmbeddingCollection.from_float(ec)(bad)
    dyn = EmbeddingConfig(num_embeddings=64, embedding_dim=8, name="d", dynamic=DynamicConfig(eviction="lru"))
    with pytest.raises(UnsupportedFeatureError, match=r"dynamic tables \['d'\] are not quantized as sequence tables"):
        QuantEmbeddingCollection([dyn])
    with pytest.raises(ValueError, match="int4 needs embedding_dim a multiple of 4"):
        QuantEmbeddingCollection([EmbeddingConfig(num_embeddings=4, embedding_dim=6, name="odd")], "int4")
    meta = EmbeddingCollection([EmbeddingConfig(num_embeddings=4, embedding_dim=8, name="m")], torch.device("meta"))
    with pytest.raises(ValueError, match="on the meta device"):
        QuantEmbeddingCollection.from_float(meta)


def test_bad_tables_and_a_missing_single_dim_are_named() -> None:
    with pytest.raises(ValueError, match="QuantEmbeddingCollection needs at least one EmbeddingConfig"):
        QuantEmbeddingCollection([])
    with pytest.raises(TypeError, match=r"QuantEmbeddingCollection takes EmbeddingConfig tables, got \['int'\]"):
        QuantEmbeddingCollection([3])  # type: ignore[list-item]
    mixed = [EmbeddingConfig(num_embeddings=4, embedding_dim=8, name="a"), EmbeddingConfig(4, 16, "b")]
    assert QuantEmbeddingCollection(mixed[:1]).embedding_dim() == 8
    with pytest.raises(ValueError, match=r"QuantEmbeddingCollection: tables have embedding dims \[8, 16\]"):
        QuantEmbeddingCollection(mixed).embedding_dim()
