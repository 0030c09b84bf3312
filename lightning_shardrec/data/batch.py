"""``RecBatch``: one training batch of a recommendation model.

::

    dense   [B, D] float32   continuous features
    sparse  KeyedJaggedTensor, stride B: one bag of ids per (feature, sample)
    labels  [B]    float32   click / no click

Lightning moves it unaided: ``move_data_to_device`` calls :meth:`RecBatch.to`.
``extract_batch_size`` (used by ``self.log``) finds ``B`` because iterating a
``RecBatch`` yields its batch-major tensors ``dense`` and ``labels`` (a KJT alone
gives Lightning no batch size and would make it warn).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.sparse.device_copy import mover


@dataclass
class RecBatch:
    """``RecBatch(dense [B, D], sparse KJT with stride B, labels [B])``.

    Not frozen on purpose: Lightning's ``apply_to_collection`` (used by the
    ``"16-true"``/``"bf16-true"``/``"64-true"`` precision plugins to cast inputs)
    rebuilds dataclasses with ``setattr``.
    """

    dense: Tensor
    sparse: KeyedJaggedTensor
    labels: Tensor

    def __post_init__(self) -> None:
        if self.dense.dim() != 2:
            raise ValueError(f"RecBatch.dense must be [B, D], got shape {tuple(self.dense.shape)}")
        if self.labels.dim() != 1:
            raise ValueError(f"RecBatch.labels must be [B], got shape {tuple(self.labels.shape)}")
        b = self.dense.shape[0]
        if self.labels.shape[0] != b:
            raise ValueError(f"RecBatch: dense has {b} rows but labels has {self.labels.shape[0]}")
        if self.sparse.keys() and self.sparse.stride() != b:
            raise ValueError(
                f"RecBatch: dense has {b} rows but sparse (keys {self.sparse.keys()}) has stride {self.sparse.stride()}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    def __iter__(self) -> Iterator[Tensor]:
        """Yield the batch-major tensors (``dense``, ``labels``): how Lightning finds ``B``."""
        yield self.dense
        yield self.labels

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> RecBatch:
        """``non_blocking=None``: asynchronous from host memory to CUDA (pageable memory is staged in pinned
        memory first, see :func:`~lightning_shardrec.sparse.device_copy.staged`)."""
        move = mover(device, non_blocking)
        sparse = self.sparse.to(torch.device(device), non_blocking=non_blocking)  # type: ignore[arg-type]  # None, above
        return RecBatch(move(self.dense), sparse, move(self.labels))

    def pin_memory(self) -> RecBatch:
        return RecBatch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as in use on ``stream`` (CUDA caching allocator)."""
        self.dense.record_stream(stream)  # type: ignore[arg-type]
        self.sparse.record_stream(stream)  # type: ignore[arg-type]
        self.labels.record_stream(stream)  # type: ignore[arg-type]
