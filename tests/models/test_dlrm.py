"""DLRM and DCNv2 as plain modules: shapes, the interaction arithmetic, and every error message."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.models import DLRM, CrossNet, DCNv2


def ebc(num_tables: int = 3, dim: int = 4, rows: int = 10) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
            for i in range(num_tables)
        ]
    )


def kjt(num_features: int, batch: int, rows: int = 10) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 3, (num_features * batch,))
    values = torch.randint(0, rows, (int(lengths.sum()),))
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(num_features)], values=values, lengths=lengths)


def test_dot_interaction_matches_pairwise_loop():
    model = DLRM(ebc(3, 4), dense_in_features=5, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[6, 1])
    dense, sparse = torch.randn(2, 5), kjt(3, 2)
    assert model(dense, sparse).shape == (2, 1)
    d = model.dense_arch(dense)
    pooled = model.sparse_arch(sparse).view(2, 3, 4)
    vecs = [d] + [pooled[:, i] for i in range(3)]
    want = torch.cat([d] + [(vecs[i] * vecs[j]).sum(1, keepdim=True) for i in range(4) for j in range(i + 1, 4)], 1)
    torch.testing.assert_close(model.inter_arch(d, model.sparse_arch(sparse)), want)
    assert model.inter_arch.out_features == 4 + 3 * 4 // 2


def test_concat_is_the_benchmark_workload_shape():
    """Issue 10: bottom 13->128->64, concat(dense, 8 pooled x 64) = 576, top 576->256->1."""
    model = DLRM(ebc(8, 64), 13, [128, 64], [256, 1], interaction="concat")
    assert model.over_arch[0].in_features == 576
    assert [m.out_features for m in model.over_arch if isinstance(m, torch.nn.Linear)] == [256, 1]
    assert model(torch.randn(3, 13), kjt(8, 3)).shape == (3, 1)


def test_dcn_cross_layer_formula_and_low_rank():
    net = CrossNet(6, num_layers=2)
    x0 = torch.randn(4, 6)
    x1 = x0 * net.weights[0](x0) + x0
    torch.testing.assert_close(net(x0), x0 * net.weights[1](x1) + x1)
    low = CrossNet(6, num_layers=1, low_rank=2)
    assert low.weights[0][0].weight.shape == (2, 6)
    model = DCNv2(ebc(3, 4), 5, [8, 4], [6, 1], dcn_num_layers=2, dcn_low_rank_dim=3)
    assert model(torch.randn(2, 5), kjt(3, 2)).shape == (2, 1)


def test_model_errors():
    with pytest.raises(ValueError, match=r"unknown DLRM interaction 'cross'; available: dot, concat"):
        DLRM(ebc(), 5, [8, 4], [1], interaction="cross")
    with pytest.raises(ValueError, match=r"dense_arch_layer_sizes\[-1\] = 8\), got table dims \[4\]"):
        DLRM(ebc(), 5, [8], [1])
    with pytest.raises(ValueError, match=r"over_arch_layer_sizes must end in 1 \(one logit per sample\), got \[4, 2\]"):
        DLRM(ebc(), 5, [4], [4, 2])
    with pytest.raises(ValueError, match=r"MLP layer sizes must be a non-empty list of positive ints, got \[4, 0\]"):
        DLRM(ebc(), 5, [4, 0], [1])
    with pytest.raises(ValueError, match=r"CrossNet: num_layers must be an int >= 1, got 0"):
        CrossNet(6, num_layers=0)
    with pytest.raises(ValueError, match=r"CrossNet: low_rank must be None \(full rank\) or an int in \[1, 6\]"):
        CrossNet(6, num_layers=1, low_rank=7)
