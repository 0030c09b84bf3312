"""Batched embedding kernels: fbgemm TBE where it runs, portable PyTorch elsewhere."""

from __future__ import annotations

import torch

from lightning_shardrec._fbgemm import fbgemm_available, fbgemm_ops_on
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.errors import unknown_name
from lightning_shardrec.kernels.autotune import Agree, KernelChoice, Workload, choose_kernel
from lightning_shardrec.kernels.base import BatchedEmbeddingKernel, KernelBackend, TableSpec
from lightning_shardrec.kernels.fbgemm_kernel import FbgemmBatchedEmbedding, fbgemm_unsupported_reason
from lightning_shardrec.kernels.torch_kernel import TorchBatchedEmbedding

# Every backend ``kernel="auto"`` may time, in order of preference on a tie.
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


def runnable(device: torch.device, optim: FusedOptimConfig, dims: list[int]) -> dict[KernelBackend, str | None]:
    """Per backend: None when it can run this optimizer/device/dims here, else why not."""
    fbgemm: str | None
    if not fbgemm_available():
        fbgemm = "fbgemm_gpu is not installed (or does not load)"
    elif device.type == "cuda" and not fbgemm_ops_on("cuda"):
        fbgemm = "the installed fbgemm_gpu has no CUDA kernels"
    else:
        fbgemm = fbgemm_unsupported_reason(device, optim, dims)
    return {KernelBackend.FBGEMM: fbgemm, KernelBackend.TORCH: None}


def choose_backend(
    kernel: str | KernelBackend, device: torch.device, optim: FusedOptimConfig, dims: list[int]
) -> KernelBackend:
    """Without timing: the pinned backend, else fbgemm where it can run here, else torch.

    :func:`choose` (what the sharded collections call) times the runnable ones instead.
    """
    backend = parse_backend(kernel)
    if backend is not KernelBackend.AUTO:
        return backend
    ok = [b for b, reason in runnable(device, optim, dims).items() if reason is None]
    return ok[0]


def choose(
    tables: list[TableSpec],
    feature_table: list[int],
    optim: FusedOptimConfig,
    *,
    pooled: bool,
    device: torch.device | str,
    kernel: str | KernelBackend = KernelBackend.AUTO,
    workload: Workload | None = None,
    agree: Agree | None = None,
) -> KernelChoice:
    """The backend for one group (``auto``: timed, see :mod:`lightning_shardrec.kernels.autotune`)."""
    device = torch.device(device)
    return choose_kernel(
        parse_backend(kernel),
        runnable(device, optim, [t.embedding_dim for t in tables]),
        _BACKENDS,
        tables,
        feature_table,
        optim,
        pooled=pooled,
        device=device,
        workload=workload or Workload(),
        agree=agree,
    )


def make_kernel(
    tables: list[TableSpec],
    feature_table: list[int],
    optim: FusedOptimConfig,
    *,
    pooled: bool,
    device: torch.device | str,
    kernel: str | KernelBackend = KernelBackend.AUTO,
    workload: Workload | None = None,
) -> BatchedEmbeddingKernel:
    """Build the kernel for one group of tables on ``device`` (backend per ``kernel``; ``auto``: timed)."""
    device = torch.device(device)
    choice = choose(tables, feature_table, optim, pooled=pooled, device=device, kernel=kernel, workload=workload)
    return _BACKENDS[choice.backend](tables, feature_table, optim, pooled=pooled, device=device)


__all__ = [
    "BatchedEmbeddingKernel",
    "FbgemmBatchedEmbedding",
    "KernelBackend",
    "KernelChoice",
    "TableSpec",
    "TorchBatchedEmbedding",
    "Workload",
    "choose",
    "choose_backend",
    "make_kernel",
    "parse_backend",
    "runnable",
]
