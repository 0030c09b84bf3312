"""``Batch`` at TorchRec's path (``torchrec.datasets.utils``): a :class:`RecBatch` with TorchRec's field names."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.errors import missing_names
from lightning_shardrec.sparse import KeyedJaggedTensor


class Batch(RecBatch):
    """``Batch(dense_features [B, D], sparse_features KJT, labels [B])``; ``dense``/``sparse`` name the same tensors."""

    def __init__(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor, labels: Tensor) -> None:
        super().__init__(dense_features, sparse_features, labels)

    @property
    def dense_features(self) -> Tensor:
        return self.dense

    @property
    def sparse_features(self) -> KeyedJaggedTensor:
        return self.sparse

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> Batch:
        moved = super().to(device, non_blocking)
        return Batch(moved.dense, moved.sparse, moved.labels)

    def pin_memory(self) -> Batch:
        pinned = super().pin_memory()
        return Batch(pinned.dense, pinned.sparse, pinned.labels)


__getattr__ = missing_names(
    __name__,
    {
        "LoadFiles": "TorchRec's file loaders are not provided; use lightning_shardrec.data (CriteoDataModule)",
        "ReadLinesFromCSV": "use lightning_shardrec.data.CriteoReader",
        "rand_split_train_val": "split the data with your DataModule",
        "train_filter": "split the data with your DataModule",
        "val_filter": "split the data with your DataModule",
        "idx_split_train_val": "split the data with your DataModule",
        "safe_cast": "not provided",
    },
)

__all__ = ["Batch"]
