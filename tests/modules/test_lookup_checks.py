"""A KJT may hold anything (as in TorchRec); the embedding collections check ids where they look them up."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

T = torch.tensor


def ebc(is_weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t_user", feature_names=["user"]),
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t_ad", feature_names=["ad", "ad2"]),
        ],
        is_weighted=is_weighted,
    )


KEYS = ["user", "ad", "ad2"]


def test_lookup_checks_ids_the_kjt_accepts() -> None:
    """Float ids, 2-D values and integer weights build a KJT, and fail at lookup with a named error."""
    float_ids = KeyedJaggedTensor(KEYS, T([1.0, 2.0, 3.0]), lengths=T([1, 1, 1]))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "EmbeddingBagCollection: KeyedJaggedTensor ids must be integers, got dtype torch.float32 "
            "for keys ['user', 'ad', 'ad2']"
        ),
    ):
        ebc()(float_ids)
    rows = KeyedJaggedTensor(KEYS, torch.zeros(3, 2, dtype=torch.int64), lengths=T([1, 1, 1]))
    with pytest.raises(ValueError, match=re.escape("KeyedJaggedTensor values must be 1-D ids, got shape (3, 2)")):
        ebc()(rows)
    int_weights = KeyedJaggedTensor(KEYS, T([1, 1, 1]), T([1, 1, 1]), T([1, 1, 1]))
    msg = "EmbeddingBagCollection(is_weighted=True): weights must be a 1-D float tensor (one per id), got shape (3,)"
    with pytest.raises(ValueError, match=re.escape(msg) + ".*dtype torch.int64"):
        ebc(is_weighted=True)(int_weights)
    ebc()(int_weights)  # an unweighted collection ignores the weights, whatever they hold
    ec = EmbeddingCollection([EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])])
    with pytest.raises(ValueError, match=r"EmbeddingCollection: KeyedJaggedTensor ids must be integers"):
        ec(KeyedJaggedTensor(["f"], T([1.0]), lengths=T([1])))


@pytest.mark.parametrize("is_weighted", [False, True])
def test_values_past_the_last_bag_are_ignored(is_weighted: bool) -> None:
    """The tail past ``sum(lengths)`` is no id: it is neither looked up nor range-checked."""
    module = ebc(is_weighted)
    weights = T([0.5, 1.0, 2.0, 3.0]) if is_weighted else None
    exact = KeyedJaggedTensor(["ad", "user", "ad2"], T([1, 2, 3, 4]), weights, T([2, 1, 1]))
    tail_weights = None if weights is None else torch.cat([weights, T([7.0, 7.0, 7.0])])
    longer = KeyedJaggedTensor(["ad", "user", "ad2"], T([1, 2, 3, 4, 999, -5]), tail_weights, T([2, 1, 1]))
    torch.testing.assert_close(module(longer).values(), module(exact).values())


def test_embedding_collection_ignores_the_tail() -> None:
    ec = EmbeddingCollection([EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])])
    out = ec(KeyedJaggedTensor(["f"], T([4, 1, 77]), lengths=T([2])))
    torch.testing.assert_close(out["f"].values(), ec.embeddings["t"].weight[[4, 1]])
