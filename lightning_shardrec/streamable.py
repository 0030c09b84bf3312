"""TorchRec's batch interfaces (``torchrec.streamable``): what a pipeline needs of a batch.

A user's batch class subclasses :class:`Pipelineable` and implements ``to(device, non_blocking)``
(returning the moved batch) and ``record_stream(stream)``; ``TrainPipelineSparseDist`` moves each
batch with ``to`` and prefetches the ``KeyedJaggedTensor`` fields it finds on it.
"""

from __future__ import annotations

import abc

import torch


class Multistreamable(abc.ABC):
    """An object that may be used on another CUDA stream than the one that made it."""

    @abc.abstractmethod
    def record_stream(self, stream: torch.Stream) -> None:
        """Mark the tensors as in use by ``stream`` (``torch.Tensor.record_stream``)."""


class Pipelineable(Multistreamable):
    """A batch a pipeline can move: ``batch = batch.to(device, non_blocking=True)`` (``to`` may return a copy)."""

    @abc.abstractmethod
    def to(self, device: torch.device, non_blocking: bool) -> Pipelineable:
        """The batch on ``device``."""


__all__ = ["Multistreamable", "Pipelineable"]
