"""Synthetic generator: determinism, rank slicing, statistics, learnable labels, errors."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_shardrec.configs import EmbeddingBagConfig
from lightning_shardrec.data import (
    FeatureSpec,
    RecBatch,
    RecBatchLoader,
    SyntheticRecDataset,
    SyntheticRecGenerator,
    SyntheticSpec,
    benchmark_features,
    benchmark_tables,
)
from lightning_shardrec.data.synthetic import to_features, zipf_cdf

SMALL = (
    FeatureSpec(name="a", num_embeddings=1000),
    FeatureSpec(name="b", num_embeddings=50, pooling_factor=2.0),
)


def _equal(x: RecBatch, y: RecBatch) -> bool:
    return (
        torch.equal(x.dense, y.dense)
        and torch.equal(x.labels, y.labels)
        and x.sparse.keys() == y.sparse.keys()
        and torch.equal(x.sparse.values(), y.sparse.values())
        and torch.equal(x.sparse.lengths(), y.sparse.lengths())
        and (
            x.sparse.weights_or_none() is None
            or torch.equal(x.sparse.weights(), y.sparse.weights())
        )
    )


def _cat(batches: list[RecBatch]) -> RecBatch:
    """Concatenate rank slices along the batch (KJT lengths are key-major)."""
    keys = batches[0].sparse.keys()
    values, weights, lengths = [], [], []
    for k in keys:
        for b in batches:
            jt = b.sparse[k]
            values.append(jt.values())
            lengths.append(jt.lengths())
            if b.sparse.weights_or_none() is not None:
                weights.append(jt.weights())
    from lightning_shardrec.sparse import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(
        keys, torch.cat(values), torch.cat(weights) if weights else None, lengths=torch.cat(lengths)
    )
    return RecBatch(
        torch.cat([b.dense for b in batches]), kjt, torch.cat([b.labels for b in batches])
    )


def test_deterministic_per_seed_and_differs_across_seeds_and_streams() -> None:
    spec = SyntheticSpec(features=SMALL, num_dense=3, weighted=True, seed=7)
    a = SyntheticRecGenerator(spec).global_batch(5, 64)
    assert _equal(a, SyntheticRecGenerator(spec).global_batch(5, 64))
    other_seed = SyntheticSpec(features=SMALL, num_dense=3, weighted=True, seed=8)
    assert not _equal(a, SyntheticRecGenerator(other_seed).global_batch(5, 64))
    assert not _equal(a, SyntheticRecGenerator(spec).global_batch(6, 64))
    assert not _equal(a, SyntheticRecGenerator(spec).global_batch(5, 64, stream=1))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_are_disjoint_complete_and_equal_one_rank_with_b_times_w(world_size: int) -> None:
    spec = SyntheticSpec(features=SMALL, num_dense=4, weighted=True, seed=1)
    gen = SyntheticRecGenerator(spec)
    b, n = 8, 3
    per_rank = [
        list(
            SyntheticRecDataset(
                spec, batch_size=b, num_batches=n, rank=r, world_size=world_size, generator=gen
            )
        )
        for r in range(world_size)
    ]
    single = list(
        SyntheticRecDataset(spec, batch_size=b * world_size, num_batches=n, generator=gen)
    )
    assert all(len(batches) == n for batches in per_rank)  # same count on every rank
    for i in range(n):
        slices = [per_rank[r][i] for r in range(world_size)]
        assert all(s.batch_size == b for s in slices)
        assert _equal(
            _cat(slices), single[i]
        )  # disjoint slices covering the global batch, in order


def test_statistics_match_parameters() -> None:
    n, alpha, pf, empty = 10_000, 1.05, 6.0, 0.1
    spec = SyntheticSpec(
        features=(FeatureSpec(name="x", num_embeddings=n),),
        pooling_factor=pf,
        empty_fraction=empty,
        zipf_alpha=alpha,
    )
    gen = SyntheticRecGenerator(spec)
    batches = [gen.global_batch(i, 4096) for i in range(8)]
    lengths = torch.cat([b.sparse.lengths() for b in batches]).double()
    ids = torch.cat([b.sparse.values() for b in batches])
    assert lengths.mean().item() == pytest.approx((1 - empty) * pf, rel=0.02)
    expected_empty = empty + (1 - empty) * math.exp(-pf)
    assert (lengths == 0).double().mean().item() == pytest.approx(expected_empty, abs=0.01)
    assert ids.min() >= 0 and ids.max() < n
    counts = torch.bincount(ids, minlength=n).double()
    top = counts.sort(descending=True).values
    share = top[: n // 100].sum() / counts.sum()
    theory = zipf_cdf(n, alpha)[n // 100 - 1].item()
    assert share.item() == pytest.approx(theory, abs=0.02)
    # the hottest ids are scattered by the permutation, not 0..9
    assert set(counts.argsort(descending=True)[:10].tolist()) != set(range(10))


def test_weights_and_dtypes() -> None:
    spec = SyntheticSpec(features=SMALL, num_dense=2, weighted=True)
    batch = SyntheticRecGenerator(spec).global_batch(0, 32)
    assert batch.dense.dtype == torch.float32 and batch.labels.dtype == torch.float32
    assert batch.sparse.values().dtype == torch.int64
    w = batch.sparse.weights()
    assert w.numel() == batch.sparse.values().numel() and bool(((w >= 0) & (w < 1)).all())
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    unweighted = SyntheticRecGenerator(SyntheticSpec(features=SMALL)).global_batch(0, 32)
    assert unweighted.sparse.weights_or_none() is None


def _auroc(score: torch.Tensor, labels: torch.Tensor) -> float:
    ranks = score.argsort().argsort().double() + 1
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def test_labels_are_learnable_from_dense_and_ids() -> None:
    spec = SyntheticSpec(
        features=(FeatureSpec(name="x", num_embeddings=100),),
        num_dense=4,
        pooling_factor=1.0,
        empty_fraction=0.0,
    )
    gen = SyntheticRecGenerator(spec)
    train, test = gen.global_batch(0, 20_000), gen.global_batch(1, 20_000)
    # dense part: least squares on the dense features ranks held-out labels well above chance
    w = torch.linalg.lstsq(train.dense.double(), train.labels.double()[:, None] - 0.5).solution
    assert _auroc((test.dense.double() @ w).squeeze(1), test.labels) > 0.6

    # sparse part: the click rate per id, learnt on train, ranks held-out labels above chance
    def first_id(b: RecBatch) -> torch.Tensor:
        return b.sparse.values()[b.sparse.offsets()[:-1].clamp(max=b.sparse.values().numel() - 1)]

    ids = first_id(train)
    ctr = torch.zeros(100).index_add_(0, ids, train.labels) / torch.bincount(
        ids, minlength=100
    ).clamp(min=1)
    assert _auroc(ctr[first_id(test)], test.labels) > 0.55


def test_tables_from_configs_dicts_and_benchmark() -> None:
    cfg = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["u", "v"])
    feats = to_features([cfg, {"name": "w", "num_embeddings": 5, "pooling_factor": 1.5}])
    assert [(f.name, f.num_embeddings) for f in feats] == [("u", 10), ("v", 10), ("w", 5)]
    bench = benchmark_features()
    assert [f.num_embeddings for f in bench] == [200_000] * 4 + [20_000] * 4
    assert [t.feature_names for t in benchmark_tables()] == [[f.name] for f in bench]
    assert SyntheticSpec(features=bench).pooling_factors() == [8.9] * 8


def test_benchmark_workload_mean_bag_is_eight() -> None:
    gen = SyntheticRecGenerator(SyntheticSpec(features=benchmark_features()))
    lengths = torch.cat([gen.global_batch(i, 2048).sparse.lengths() for i in range(2)]).double()
    assert lengths.mean().item() == pytest.approx(8.0, rel=0.02)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"features": ()}, "need at least one sparse feature"),
        (
            {"features": (FeatureSpec(name="a", num_embeddings=3),) * 2},
            r"feature names repeat: \['a'\]",
        ),
        ({"features": SMALL, "num_dense": -1}, "num_dense must be an int >= 0, got -1"),
        ({"features": SMALL, "pooling_factor": -1.0}, "pooling_factor must be >= 0, got -1.0"),
        (
            {"features": SMALL, "empty_fraction": 1.5},
            r"empty_fraction must be in \[0, 1\], got 1.5",
        ),
        (
            {"features": SMALL, "zipf_alpha": -0.5},
            r"zipf_alpha must be >= 0 \(0 is uniform\), got -0.5",
        ),
        ({"features": ("oops",)}, "expected FeatureSpec, EmbeddingBagConfig or a dict"),
    ],
)
def test_spec_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticSpec(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "", "num_embeddings": 3}, "FeatureSpec needs a feature name"),
        (
            {"name": "a", "num_embeddings": 0},
            r"FeatureSpec\(name='a'\): num_embeddings must be a positive int, got 0",
        ),
        (
            {"name": "a", "num_embeddings": 3, "pooling_factor": -2.0},
            "pooling_factor must be >= 0, got -2.0",
        ),
    ],
)
def test_feature_spec_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FeatureSpec(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"batch_size": 0, "num_batches": 1},
            "SyntheticRecDataset: batch_size must be a positive int, got 0",
        ),
        ({"batch_size": 2, "num_batches": -1}, "num_batches must be an int >= 0, got -1"),
        (
            {"batch_size": 2, "num_batches": 1, "world_size": 0},
            "world_size must be a positive int, got 0",
        ),
        (
            {"batch_size": 2, "num_batches": 1, "rank": 2, "world_size": 2},
            r"rank must be in \[0, 2\)",
        ),
        (
            {"batch_size": 2, "num_batches": 1, "stream": "dev"},
            "unknown stream 'dev'; available: train, val, test",
        ),
    ],
)
def test_dataset_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticRecDataset(SyntheticSpec(features=SMALL), **kwargs)


def test_batch_index_out_of_range() -> None:
    ds = SyntheticRecDataset(SyntheticSpec(features=SMALL), batch_size=2, num_batches=2)
    with pytest.raises(IndexError, match=r"batch index 2 not in \[0, 2\)"):
        ds.batch(2)


def test_loader_with_workers_keeps_order() -> None:
    spec = SyntheticSpec(features=SMALL, num_dense=2)
    ds = SyntheticRecDataset(spec, batch_size=4, num_batches=5, rank=1, world_size=2)
    expected = [ds.batch(i) for i in range(5)]
    got = list(RecBatchLoader(ds, num_workers=2))
    assert len(got) == 5 and all(_equal(a, b) for a, b in zip(got, expected, strict=True))
