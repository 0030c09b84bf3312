"""Any table name works, the names of ModuleDict's methods included (``items``, ``keys``, ...)."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection

CLASHING = ["items", "keys", "values", "update", "pop", "get", "clear", "forward", "training"]


def _kjt(names: list[str]) -> KeyedJaggedTensor:
    lengths = torch.tensor([1, 2] * len(names))
    return KeyedJaggedTensor([f"f_{n}" for n in names], torch.arange(int(lengths.sum())) % 5, lengths=lengths)


def test_bag_collection_takes_module_dict_method_names() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=5, embedding_dim=4, feature_names=[f"f_{n}"]) for n in CLASHING]
    )
    assert list(ebc.state_dict()) == [f"embedding_bags.{n}.weight" for n in CLASHING]
    assert callable(ebc.embedding_bags.items) and list(ebc.embedding_bags.keys()) == CLASHING
    out = ebc(_kjt(CLASHING))
    bags = _kjt(CLASHING)
    for n in CLASHING:
        w, jt = ebc.embedding_bags[n].weight, bags[f"f_{n}"]
        want = torch.stack([w[ids].sum(0) for ids in jt.to_dense()])
        torch.testing.assert_close(out[f"f_{n}"], want)
    other = EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=5, embedding_dim=4, feature_names=[f"f_{n}"]) for n in CLASHING]
    )
    other.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(other(_kjt(CLASHING)).values(), out.values())
    assert [n for n, _ in ebc.named_parameters()] == list(ebc.state_dict())


def test_sequence_collection_and_quantized_copy_take_them_too() -> None:
    names = CLASHING[:5]
    ec = EmbeddingCollection(
        [EmbeddingConfig(name=n, num_embeddings=5, embedding_dim=4, feature_names=[f"f_{n}"]) for n in names]
    )
    assert list(ec.state_dict()) == [f"embeddings.{n}.weight" for n in names]
    rows = ec(_kjt(names))
    torch.testing.assert_close(rows["f_items"].values(), ec.embeddings["items"].weight[_kjt(names)["f_items"].values()])
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=5, embedding_dim=4, feature_names=[f"f_{n}"]) for n in names]
    )
    quant = QuantEmbeddingBagCollection.from_float(ebc, "fp16")
    assert {k.split(".")[1] for k in quant.state_dict()} == set(names)
    torch.testing.assert_close(quant(_kjt(names)).values(), ebc(_kjt(names)).values(), atol=1e-2, rtol=1e-2)


def test_a_dot_in_a_table_name_is_a_named_error() -> None:
    with pytest.raises(ValueError, match=r"EmbeddingBagConfig\(name='user.id'\): a table name cannot contain '\.'"):
        EmbeddingBagConfig(name="user.id", num_embeddings=5, embedding_dim=4, feature_names=["f"])
