"""``RandomRecDataset`` at TorchRec's path (``torchrec.datasets.random``): random batches for smoke runs.

Each batch draws, from one generator and in this order: per feature, ``B`` int32 lengths
uniform in ``[min_ids, ids]`` then that many ids in ``[0, hash_size)``; then ``[B, num_dense]``
normal dense features; then ``B`` labels in ``{0, 1}``. ``num_generated_batches`` batches are
drawn up front and repeated (negative: a new batch every time); ``num_batches`` ends the
iteration (None: never).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

from lightning_shardrec.compat.torchrec.datasets.utils import Batch
from lightning_shardrec.sparse import KeyedJaggedTensor


def _per_key(name: str, one: int | None, many: list[int] | None, keys: list[str], default: int | None) -> list[int]:
    if many is not None:
        if len(many) != len(keys):
            raise ValueError(f"RandomRecDataset: {name}s has {len(many)} entries for {len(keys)} keys {keys}")
        return list(many)
    value = one if one is not None else default
    if value is None:
        raise ValueError(f"RandomRecDataset: pass {name} or {name}s")
    return [value] * len(keys)


class RandomRecDataset(IterableDataset[Batch]):
    """TorchRec's arguments: ``(keys, batch_size, hash_size=None, hash_sizes=None, ids_per_feature=None,
    ids_per_features=None, num_dense=50, manual_seed=None, num_generated_batches=10, num_batches=None,
    *, min_ids_per_feature=None, min_ids_per_features=None)``."""

    def __init__(
        self,
        keys: list[str],
        batch_size: int,
        hash_size: int | None = None,
        hash_sizes: list[int] | None = None,
        ids_per_feature: int | None = None,
        ids_per_features: list[int] | None = None,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_generated_batches: int = 10,
        num_batches: int | None = None,
        *,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.keys = list(keys)
        self.batch_size = batch_size
        self.hash_sizes = _per_key("hash_size", hash_size, hash_sizes, self.keys, 100)
        self.ids_per_features = _per_key("ids_per_feature", ids_per_feature, ids_per_features, self.keys, 2)
        self.min_ids_per_features = _per_key(
            "min_ids_per_feature", min_ids_per_feature, min_ids_per_features, self.keys, 0
        )
        for key, lo, hi in zip(self.keys, self.min_ids_per_features, self.ids_per_features, strict=True):
            if not 0 <= lo <= hi:
                raise ValueError(f"RandomRecDataset: feature '{key}': ids per sample must satisfy 0 <= {lo} <= {hi}")
        self.num_dense = num_dense
        self.manual_seed = manual_seed
        self.num_generated_batches = num_generated_batches
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Batch]:
        generator = None
        if self.manual_seed is not None:
            generator = torch.Generator().manual_seed(self.manual_seed)
        cached = [self._batch(generator) for _ in range(max(self.num_generated_batches, 0))]
        i = 0
        while i != self.num_batches:
            yield cached[i % len(cached)] if cached else self._batch(generator)
            i += 1

    def __len__(self) -> int:
        """``num_batches`` (TorchRec's ``len``); an endless dataset (``num_batches=None``) has no length."""
        if self.num_batches is None:
            raise TypeError("RandomRecDataset(num_batches=None) is endless: it has no len()")
        return self.num_batches

    def _batch(self, generator: torch.Generator | None) -> Batch:
        b = self.batch_size
        values, lengths = [], []
        for size, lo, hi in zip(self.hash_sizes, self.min_ids_per_features, self.ids_per_features, strict=True):
            length = torch.randint(lo, hi + 1, (b,), dtype=torch.int32, generator=generator)
            lengths.append(length)
            values.append(torch.randint(0, size, (int(length.sum()),), generator=generator))
        sparse = KeyedJaggedTensor.from_lengths_sync(self.keys, torch.cat(values), torch.cat(lengths))
        dense = torch.randn(b, self.num_dense, generator=generator)
        labels = torch.randint(0, 2, (b,), generator=generator)
        return Batch(dense, sparse, labels)


__all__ = ["RandomRecDataset"]
