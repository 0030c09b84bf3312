"""Variable batch per feature (VBE) through the unsharded collections, as TorchRec:
each feature pools its own bags, and the EBC expands them to the batch by ``inverse_indices``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from lightning_shardrec.modules.vbe import expand_vbe, inverse_rows, pad_vbe

KEYS = ["f0", "f1", "f2"]
# f0: 1 bag [[1, 2]] for all 3 samples; f1: 3 bags [[3], [4, 5], []]; f2: 2 bags [[6], [7, 8, 9]]
INVERSE = torch.tensor([[0, 0, 0], [0, 1, 2], [1, 0, 1]])


def vbe(weighted: bool = False, inverse: torch.Tensor | None = INVERSE) -> KeyedJaggedTensor:
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    weights = torch.linspace(0.5, 2.0, 9) if weighted else None
    return KeyedJaggedTensor(
        KEYS,
        values,
        weights,
        torch.tensor([2, 1, 2, 0, 1, 3]),
        stride_per_key_per_rank=[[1], [3], [2]],
        inverse_indices=None if inverse is None else (KEYS, inverse),
    )


def expanded_by_hand(weighted: bool) -> KeyedJaggedTensor:
    """The same batch with every sample's bag written out (3 samples per feature)."""
    bags = {"f0": [[1, 2]] * 3, "f1": [[3], [4, 5], []], "f2": [[7, 8, 9], [6], [7, 8, 9]]}
    wt = dict(zip(range(1, 10), torch.linspace(0.5, 2.0, 9).tolist(), strict=True))
    values = [v for f in KEYS for b in bags[f] for v in b]
    return KeyedJaggedTensor(
        KEYS,
        torch.tensor(values),
        torch.tensor([wt[v] for v in values]) if weighted else None,
        torch.tensor([len(b) for f in KEYS for b in bags[f]]),
    )


def tables(pooling: PoolingType) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(10, 4, "t0", feature_names=["f0", "f1"], pooling=pooling),
        EmbeddingBagConfig(10, 3, "t1", feature_names=["f2"], pooling=pooling),
        EmbeddingBagConfig(10, 2, "t2", feature_names=["f0"], pooling=pooling),  # f0 shared: f0@t0, f0@t2
    ]


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_pools_each_feature_then_expands(pooling: PoolingType, weighted: bool) -> None:
    ebc = EmbeddingBagCollection(tables(pooling), is_weighted=weighted)
    got = ebc(vbe(weighted))
    assert got.keys() == ["f0@t0", "f1", "f2", "f0@t2"] and got.values().shape == (3, 13)
    # pooled once per bag, and the rows TorchRec gives: f0's one bag for every sample, f2's bag 1 twice
    dense = expanded_by_hand(weighted)
    for key, table, f in [("f0@t0", "t0", "f0"), ("f1", "t0", "f1"), ("f2", "t1", "f2"), ("f0@t2", "t2", "f0")]:
        jt = dense[f]
        want = F.embedding_bag(
            jt.values(),
            ebc.embedding_bags[table].weight,
            jt.offsets()[:-1],
            mode="sum",
            per_sample_weights=jt.weights() if weighted else None,
        )
        if pooling is PoolingType.MEAN:
            want = want / jt.lengths().clamp(min=1).unsqueeze(1)
        torch.testing.assert_close(got[key], want)
    torch.testing.assert_close(got.values(), ebc(dense).values())


def test_ebc_vbe_gradients_equal_the_expanded_batch() -> None:
    ebc = EmbeddingBagCollection(tables(PoolingType.MEAN), is_weighted=True)
    grads = []
    for kjt in (vbe(True), expanded_by_hand(True)):
        ebc.zero_grad()
        (ebc(kjt).values() * torch.arange(39.0).view(3, 13)).sum().backward()
        grads.append([ebc.embedding_bags[t].weight.grad.clone() for t in ("t0", "t1", "t2")])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_ebc_vbe_on_meta_gives_the_batch_shape() -> None:
    ebc = EmbeddingBagCollection(tables(PoolingType.SUM), device="meta")
    out = ebc(vbe())
    assert out.values().device.type == "meta" and out.values().shape == (3, 13)


def test_vbe_without_inverse_indices_is_named() -> None:
    ebc = EmbeddingBagCollection(tables(PoolingType.SUM))
    msg = (
        r"EmbeddingBagCollection got a variable-batch KeyedJaggedTensor \(stride_per_key "
        r"\[1, 3, 2\] for keys \['f0', 'f1', 'f2'\]\) without inverse_indices"
    )
    with pytest.raises(ValueError, match=msg):
        ebc(vbe(inverse=None))


def test_inverse_indices_must_cover_the_features() -> None:
    kjt = vbe()
    with pytest.raises(KeyError, match=r"EBC: inverse_indices keys \['f0', 'f1', 'f2'\] lack features \['f9'\]"):
        inverse_rows(kjt, ["f0", "f9"], "EBC")


def test_expand_checks_the_inverse_range() -> None:
    bad = INVERSE.clone()
    bad[2, 1] = 2  # f2 has 2 bags
    kjt = vbe(inverse=bad)
    with pytest.raises(ValueError, match=r"inverse_indices of feature 'f2' span \[1, 2\], outside its 2 bags \[0, 2\)"):
        expand_vbe(kjt, inverse_rows(kjt, KEYS, "EBC"))


def test_expand_and_pad() -> None:
    kjt = vbe(weighted=True)
    dense = expand_vbe(kjt, inverse_rows(kjt, KEYS, "EBC"))
    want = expanded_by_hand(weighted=True)
    assert dense.stride() == 3 and not dense.variable_stride_per_key()
    assert torch.equal(dense.values(), want.values()) and torch.equal(dense.lengths(), want.lengths())
    torch.testing.assert_close(dense.weights(), want.weights())
    padded = pad_vbe(kjt)
    assert padded.stride() == 3 and padded.lengths().tolist() == [2, 0, 0, 1, 2, 0, 1, 3, 0]
    assert torch.equal(padded.values(), kjt.values())


def test_ec_keeps_each_features_own_bags() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(10, 4, "t0", feature_names=["f0", "f1"]), EmbeddingConfig(10, 4, "t1", feature_names=["f2"])],
        need_indices=True,
    )
    out = ec(vbe())
    assert {k: v.lengths().tolist() for k, v in out.items()} == {"f0": [2], "f1": [1, 2, 0], "f2": [1, 3]}
    torch.testing.assert_close(out["f2"].values(), ec.embeddings["t1"].weight[[6, 7, 8, 9]])
    assert out["f1"].weights().tolist() == [3, 4, 5]
