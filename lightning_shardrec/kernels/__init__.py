"""Batched embedding kernels: fbgemm TBE where it runs, portable PyTorch elsewhere."""

from __future__ import annotations

import torch

from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.errors import unknown_name
from lightning_shardrec.kernels.base import BatchedEmbeddingKernel, KernelBackend, TableSpec
from lightning_shardrec.kernels.fbgemm_kernel import FbgemmBatchedEmbedding, fbgemm_unsupported_reason
from lightning_shardrec.kernels.torch_kernel import TorchBatchedEmbedding

# Where the portable kernel trains faster than fbgemm 1.8's CPU TBE (benchmarks/kernel_bench.py,
# docs/benchmarks.md "Kernels"): row-wise Adagrad, 1.5-1.8x. fbgemm stays faster for SGD and level
# for Adagrad.
TORCH_FASTER_ON_CPU = frozenset({EmbOptimType.ROWWISE_ADAGRAD})

_BACKENDS: dict[KernelBackend, type[BatchedEmbeddingKernel]] = {
    KernelBackend.FBGEMM: FbgemmBatchedEmbedding,
    KernelBackend.TORCH: TorchBatchedEmbedding,
}


def parse_backend(kernel: str | KernelBackend) -> KernelBackend:
    """A backend from a member, its value or its name, in any case (``"auto"``, ``"AUTO"``)."""
    if isinstance(kernel, KernelBackend):
        return kernel
    try:
        return KernelBackend(str(kernel).lower())
    except ValueError:
        raise unknown_name("kernel", kernel, [k.value for k in KernelBackend]) from None


def choose_backend(
    kernel: str | KernelBackend, device: torch.device, optim: FusedOptimConfig, dims: list[int]
) -> KernelBackend:
    """``auto`` -> fbgemm where it is installed, can run this optimizer/device/dims and is the
    faster of the two there; else torch."""
    backend = parse_backend(kernel)
    if backend is not KernelBackend.AUTO:
        return backend
    if device.type == "cpu" and optim.optimizer in TORCH_FASTER_ON_CPU:
        return KernelBackend.TORCH
    if fbgemm_available() and fbgemm_unsupported_reason(device, optim, dims) is None:
        return KernelBackend.FBGEMM
    return KernelBackend.TORCH


def make_kernel(
    tables: list[TableSpec],
    feature_table: list[int],
    optim: FusedOptimConfig,
    *,
    pooled: bool,
    device: torch.device | str,
    kernel: str | KernelBackend = KernelBackend.AUTO,
) -> BatchedEmbeddingKernel:
    """Build the kernel for one group of tables on ``device`` (backend per ``kernel``)."""
    device = torch.device(device)
    backend = choose_backend(kernel, device, optim, [t.embedding_dim for t in tables])
    return _BACKENDS[backend](tables, feature_table, optim, pooled=pooled, device=device)


__all__ = [
    "BatchedEmbeddingKernel",
    "FbgemmBatchedEmbedding",
    "KernelBackend",
    "TableSpec",
    "TorchBatchedEmbedding",
    "choose_backend",
    "make_kernel",
    "parse_backend",
]
