"""Per-rank batch streams that are exact across world sizes and resumable mid-epoch.

A dataset here is a fixed sequence of *global* batches ``0, 1, ..., N-1`` of
``batch_size * world_size`` samples each. Rank ``r`` yields rows
``[r * batch_size, (r + 1) * batch_size)`` of every global batch, so a run on
``W`` ranks with ``batch_size=B`` and a run on one rank with ``batch_size=B*W``
see the same global batch at every step, and every rank yields ``N`` batches::

    global batch i (G = B * W rows)   | rank 0: rows [0, B) | rank 1: rows [B, 2B) | ...

With ``num_workers=n`` DataLoader worker ``k`` produces batches ``k, k+n, ...``;
the DataLoader interleaves workers in order, so the loader still yields
``0, 1, 2, ...``. :class:`RecBatchLoader` counts the batches it handed out and
exposes ``state_dict()``/``load_state_dict()``, which Lightning's fit loop saves in
checkpoints and restores before the first ``iter()`` (mid-epoch resume).

Why not torchdata's ``StatefulDataLoader`` (0.11, tried on this dataset): its state is the
loader's own (``_num_yielded``, or with workers a ``_snapshot`` of each worker's state), so a
checkpoint resumes only on the same ``num_workers`` (0 -> 2 or 2 -> 0 fails its
``AssertionError`` "State doesn't contain key '_snapshot'"), and a dataset without its own
``state_dict`` is resumed by building and dropping every skipped batch. The state here is one
global batch index, the same on every rank, world size and worker count, and skipping costs
nothing. (torchdata is also not a dependency of the library or of its test environments.)
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_shardrec.data.batch import RecBatch


class IndexedBatchDataset(IterableDataset):
    """Base: a rank's view of ``num_batches`` global batches; subclasses define :meth:`batch`.

    ``start`` (set by :class:`RecBatchLoader` on resume) skips the first batches of
    the next iteration only.
    """

    def __init__(
        self, *, batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1
    ) -> None:
        name = type(self).__name__
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"{name}: batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"{name}: num_batches must be an int >= 0, got {num_batches!r}")
        if not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"{name}: world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"{name}: rank must be in [0, {world_size}) for world_size {world_size}, got {rank!r}"
            )
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.rank = rank
        self.world_size = world_size
        self.start = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @abc.abstractmethod
    def batch(self, index: int) -> RecBatch:
        """This rank's slice of global batch ``index``."""

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[RecBatch]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if info is not None:
            torch.set_num_threads(1)
        # read ``start`` now, not lazily at the first ``next()``
        return (self.batch(i) for i in range(self.start + worker, self.num_batches, num_workers))


class RecBatchLoader(DataLoader):
    """A DataLoader of whole :class:`RecBatch` es (``batch_size=None``) that can resume mid-epoch.

    ``state_dict()`` is ``{"next_batch": k}``: the global batch index the next
    iteration starts at (0 once an epoch was fully consumed). It does not depend on
    the rank or world size, so a checkpoint resumes on any world size.
    """

    def __init__(self, dataset: IndexedBatchDataset, **kwargs: Any) -> None:
        if kwargs.pop("batch_size", None) is not None:
            raise ValueError(
                "RecBatchLoader yields whole batches from its dataset; set batch_size on the "
                "dataset / DataModule, not on the loader (got a loader batch_size)"
            )
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "RecBatchLoader does not support persistent_workers=True: resuming mid-epoch "
                "must hand the start batch to freshly started workers"
            )
        if not isinstance(dataset, IndexedBatchDataset):
            raise ValueError(
                f"RecBatchLoader needs an IndexedBatchDataset, got {type(dataset).__name__}"
            )
        super().__init__(dataset, batch_size=None, **kwargs)
        self._yielded = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[RecBatch]:  # type: ignore[override]
        dataset: IndexedBatchDataset = self.dataset  # type: ignore[assignment]
        dataset.start, self._resume_at = self._resume_at, 0
        self._yielded = dataset.start
        try:
            iterator = super().__iter__()
        finally:
            dataset.start = 0
        return self._count(iterator)

    def _count(self, iterator: Iterator[RecBatch]) -> Iterator[RecBatch]:
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        done = self._yielded >= len(self.dataset)  # type: ignore[arg-type]
        return {"next_batch": 0 if done else self._yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        k = state_dict.get("next_batch")
        n = len(self.dataset)  # type: ignore[arg-type]
        if not isinstance(k, int) or not 0 <= k <= n:
            raise ValueError(
                f"RecBatchLoader.load_state_dict: next_batch must be an int in [0, {n}] "
                f"(this loader has {n} batches), got {k!r}"
            )
        self._resume_at = k
        self._yielded = k
