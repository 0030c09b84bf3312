"""Synthetic click logs: power-law ids, Poisson bags, learnable labels. No Lightning here.

Every global batch ``i`` is a pure function of ``(seed, stream, i)`` and its size
``G``; a rank takes its rows of it (see :mod:`lightning_shardrec.data.loader`).

Per feature ``f`` (one KJT key) with ``n`` rows:

- bag length ``~ Poisson(pooling_factor)``, then a fraction ``empty_fraction`` of
  bags forced empty, so the mean length is ``(1 - empty_fraction) * pooling_factor``
  (8.9 and 0.1 give the benchmark's 8 ids per bag);
- id rank ``r`` (1-based) has ``p(r) ~ r^-zipf_alpha`` (inverse-CDF sampling with
  ``torch.searchsorted``), mapped through a fixed random permutation of ``[0, n)``
  so the hot ids are scattered over the table;
- optional per-id weights ``U(0, 1)`` (``weighted=True``).

Dense features are ``N(0, 1)``. Labels are ``Bernoulli(sigmoid(logit))`` with
``logit = dense @ w / sqrt(D) + sqrt(3 / F) * sum_f mean(h_f(id) for id in bag f)``,
``w ~ N(0, 1)`` hidden and ``h_f(id)`` a fixed pseudo-random value in ``[-1, 1)``
per id, so a model can learn and AUROC rises above 0.5.

Memory: 16 bytes per table row (CDF per distinct ``num_embeddings``, permutation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_shardrec.configs import EmbeddingBagConfig
from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.data.loader import IndexedBatchDataset
from lightning_shardrec.sparse import KeyedJaggedTensor

_PRIME = 2**31 - 1  # modulus of the per-id hidden-weight hash
STREAMS = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """One sparse feature (KJT key): ids in ``[0, num_embeddings)``; ``pooling_factor`` overrides the default."""

    name: str
    num_embeddings: int
    pooling_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"FeatureSpec needs a feature name (got name={self.name!r})")
        if not isinstance(self.num_embeddings, int) or self.num_embeddings <= 0:
            raise ValueError(
                f"FeatureSpec(name={self.name!r}): num_embeddings must be a positive int, got {self.num_embeddings!r}"
            )
        if self.pooling_factor is not None and not self.pooling_factor >= 0:
            raise ValueError(
                f"FeatureSpec(name={self.name!r}): pooling_factor must be >= 0, got {self.pooling_factor!r}"
            )


TableLike = FeatureSpec | EmbeddingBagConfig | Mapping


def to_features(tables: Sequence[TableLike]) -> tuple[FeatureSpec, ...]:
    """Features of ``tables``: a ``FeatureSpec``, a dict of its fields, or an
    ``EmbeddingBagConfig`` (one feature per ``feature_names`` entry, the table's rows)."""
    out: list[FeatureSpec] = []
    for t in tables:
        if isinstance(t, FeatureSpec):
            out.append(t)
        elif isinstance(t, EmbeddingBagConfig):
            out.extend(
                FeatureSpec(name=f, num_embeddings=t.num_embeddings) for f in t.feature_names
            )
        elif isinstance(t, Mapping):
            out.append(FeatureSpec(**t))
        else:
            raise ValueError(
                f"synthetic tables: expected FeatureSpec, EmbeddingBagConfig or a dict with keys "
                f"name, num_embeddings[, pooling_factor]; got {type(t).__name__}: {t!r}"
            )
    names = [f.name for f in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"synthetic tables: feature names repeat: {dup}")
    if not out:
        raise ValueError("synthetic tables: need at least one sparse feature, got none")
    return tuple(out)


def benchmark_features() -> tuple[FeatureSpec, ...]:
    """The benchmark workload's features: ``f0..f3`` with 200,000 rows, ``f4..f7`` with 20,000."""
    return tuple(
        FeatureSpec(name=f"f{i}", num_embeddings=200_000 if i < 4 else 20_000) for i in range(8)
    )


def benchmark_tables(embedding_dim: int = 64) -> list[EmbeddingBagConfig]:
    """Tables ``t0..t7`` (one feature ``f<i>`` each) matching :func:`benchmark_features`."""
    return [
        EmbeddingBagConfig(
            num_embeddings=f.num_embeddings,
            embedding_dim=embedding_dim,
            name=f"t{i}",
            feature_names=[f.name],
        )
        for i, f in enumerate(benchmark_features())
    ]


@dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    """Everything that defines the synthetic distribution (one place for defaults)."""

    features: tuple[FeatureSpec, ...]
    num_dense: int = 13
    pooling_factor: float = 8.9
    empty_fraction: float = 0.1
    zipf_alpha: float = 1.05
    weighted: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", to_features(self.features))
        if not isinstance(self.num_dense, int) or self.num_dense < 0:
            raise ValueError(
                f"SyntheticSpec: num_dense must be an int >= 0, got {self.num_dense!r}"
            )
        if not self.pooling_factor >= 0:
            raise ValueError(
                f"SyntheticSpec: pooling_factor must be >= 0, got {self.pooling_factor!r}"
            )
        if not 0.0 <= self.empty_fraction <= 1.0:
            raise ValueError(
                f"SyntheticSpec: empty_fraction must be in [0, 1], got {self.empty_fraction!r}"
            )
        if not self.zipf_alpha >= 0:
            raise ValueError(
                f"SyntheticSpec: zipf_alpha must be >= 0 (0 is uniform), got {self.zipf_alpha!r}"
            )

    def pooling_factors(self) -> list[float]:
        return [
            self.pooling_factor if f.pooling_factor is None else f.pooling_factor
            for f in self.features
        ]


def _seed(*words: int) -> int:
    return int(
        np.random.SeedSequence([w & 0xFFFFFFFF for w in words]).generate_state(1, np.uint64)[0] >> 1
    )


def zipf_cdf(num_embeddings: int, alpha: float) -> Tensor:
    """``[n]`` float64 CDF of ``p(r) ~ r^-alpha`` over ranks ``1..n`` (last entry exactly 1)."""
    p = torch.arange(1, num_embeddings + 1, dtype=torch.float64).pow_(-alpha)
    cdf = p.cumsum_(0)
    return cdf.div_(cdf[-1].clone())


class SyntheticRecGenerator:
    """Makes global batches of a :class:`SyntheticSpec`; ``global_batch(i, size)`` is deterministic."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        cdfs: dict[int, Tensor] = {}
        self._cdf: list[Tensor] = []
        self._perm: list[Tensor] = []
        for k, f in enumerate(spec.features):
            n = f.num_embeddings
            if n not in cdfs:
                cdfs[n] = zipf_cdf(n, spec.zipf_alpha)
            self._cdf.append(cdfs[n])
            g = torch.Generator().manual_seed(_seed(spec.seed, 0, k))
            self._perm.append(torch.randperm(n, generator=g))
        g = torch.Generator().manual_seed(_seed(spec.seed, 1))
        self._w_dense = torch.randn(spec.num_dense, generator=g, dtype=torch.float64)
        self._hash_mult = torch.randint(1, _PRIME, (len(spec.features), 1), generator=g)
        self._rates = torch.tensor(spec.pooling_factors(), dtype=torch.float64)

    def hidden_id_weight(self, feature: int, ids: Tensor) -> Tensor:
        """The fixed pseudo-random label weight in ``[-1, 1)`` of ``ids`` of feature ``feature``."""
        return (ids.long() * self._hash_mult[feature] % _PRIME).double() * (2.0 / _PRIME) - 1.0

    def global_batch(
        self, index: int, size: int, stream: int = 0, rows: tuple[int, int] | None = None
    ) -> RecBatch:
        """Rows ``rows = (lo, hi)`` (default all) of global batch ``index`` of ``size`` samples."""
        spec = self.spec
        lo, hi = (0, size) if rows is None else rows
        num_f, b = len(spec.features), hi - lo
        g = torch.Generator().manual_seed(_seed(spec.seed, 2, stream, index))
        lengths = torch.poisson(
            self._rates[:, None].expand(num_f, size).contiguous(), generator=g
        ).long()
        lengths[torch.rand(num_f, size, generator=g) < spec.empty_fraction] = 0
        dense = torch.randn(size, spec.num_dense, generator=g)[lo:hi].clone()
        label_u = torch.rand(size, generator=g)[lo:hi]
        csum = lengths.cumsum(1)
        totals = csum[:, -1]
        uniforms = torch.rand(int(totals.sum()), generator=g, dtype=torch.float64)
        weights_all = torch.rand(uniforms.numel(), generator=g) if spec.weighted else None
        feat_start = totals.cumsum(0) - totals
        begin = (feat_start + (csum[:, lo - 1] if lo > 0 else 0)).tolist()
        end = (feat_start + csum[:, hi - 1]).tolist()
        values, weights, signal = [], [], torch.zeros(num_f * b, dtype=torch.float64)
        lengths = lengths[:, lo:hi].contiguous()
        for k in range(num_f):
            u = uniforms[begin[k] : end[k]]
            ranks = torch.searchsorted(self._cdf[k], u, right=True).clamp_(
                max=self._cdf[k].numel() - 1
            )
            ids = self._perm[k][ranks]
            values.append(ids)
            if weights_all is not None:
                weights.append(weights_all[begin[k] : end[k]])
            bag = torch.repeat_interleave(torch.arange(k * b, (k + 1) * b), lengths[k])
            signal.index_add_(0, bag, self.hidden_id_weight(k, ids))
        bag_mean = (signal / lengths.reshape(-1).clamp(min=1)).view(num_f, b).sum(0)
        logit = bag_mean * math.sqrt(3.0 / num_f)
        if spec.num_dense:
            logit = logit + dense.double() @ self._w_dense / math.sqrt(spec.num_dense)
        labels = (label_u.double() < torch.sigmoid(logit)).float()
        kjt = KeyedJaggedTensor(
            [f.name for f in spec.features],
            torch.cat(values),
            torch.cat(weights) if weights_all is not None else None,
            lengths=lengths.reshape(-1),
            stride=b,
        )
        return RecBatch(dense, kjt, labels)


class SyntheticRecDataset(IndexedBatchDataset):
    """Rank ``rank``'s slices of ``num_batches`` synthetic global batches of ``batch_size * world_size``.

    ``stream`` (``"train"``, ``"val"``, ``"test"``) selects independent batch sequences.
    """

    def __init__(
        self,
        spec: SyntheticSpec,
        *,
        batch_size: int,
        num_batches: int,
        rank: int = 0,
        world_size: int = 1,
        stream: str = "train",
        generator: SyntheticRecGenerator | None = None,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_batches=num_batches, rank=rank, world_size=world_size
        )
        if stream not in STREAMS:
            raise ValueError(
                f"SyntheticRecDataset: unknown stream {stream!r}; available: {', '.join(STREAMS)}"
            )
        self.stream = stream
        self.generator = generator if generator is not None else SyntheticRecGenerator(spec)

    def batch(self, index: int) -> RecBatch:
        if not 0 <= index < self.num_batches:
            raise IndexError(
                f"SyntheticRecDataset: batch index {index} not in [0, {self.num_batches})"
            )
        lo = self.rank * self.batch_size
        return self.generator.global_batch(
            index, self.global_batch_size, STREAMS[self.stream], rows=(lo, lo + self.batch_size)
        )
