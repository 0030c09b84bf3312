"""Host-to-device copies of a batch's tensors: asynchronous where that is safe (``KeyedJaggedTensor.to``,
``RecBatch.to``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def async_copy(t: Tensor, device: torch.device | str, non_blocking: bool | None) -> bool:
    """``non_blocking`` as given, or (None) whether ``t`` is pinned host memory bound for CUDA."""
    if non_blocking is not None:
        return non_blocking
    return torch.device(device).type == "cuda" and t.device.type == "cpu" and t.is_pinned()


def staged(t: Tensor, device: torch.device | str, non_blocking: bool | None) -> Tensor:
    """``t``, or (``non_blocking=None``, pageable host memory bound for CUDA) a pinned copy of it: a copy
    from pageable memory waits for the device (a host sync per batch); from pinned memory it does not,
    and CUDA's host allocator keeps the pinned copy alive until the transfer is done."""
    if non_blocking is None and torch.device(device).type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t


def mover(
    device: torch.device | str, non_blocking: bool | None, dtype: torch.dtype | None = None
) -> Callable[[Tensor], Tensor]:
    """``t -> t`` on ``device`` (as ``dtype``), staged and asynchronous as :func:`staged` and :func:`async_copy`
    decide."""

    def move(t: Tensor) -> Tensor:
        t = staged(t, device, non_blocking)
        return t.to(device, dtype=dtype, non_blocking=async_copy(t, device, non_blocking))

    return move
