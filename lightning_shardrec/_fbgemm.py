"""The one place that imports ``fbgemm_gpu``.

fbgemm is optional: every caller asks :func:`fbgemm_available` (which imports it
lazily, once) and falls back to plain PyTorch when it is absent or fails to load.
Importing ``fbgemm_gpu`` registers the ``torch.ops.fbgemm.*`` operators.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

# Set LIGHTNING_SHARDREC_DISABLE_FBGEMM=1 to force the portable torch paths.
_DISABLE_ENV = "LIGHTNING_SHARDREC_DISABLE_FBGEMM"


@functools.cache
def _load() -> ModuleType | None:
    if os.environ.get(_DISABLE_ENV, "0") not in ("", "0"):
        return None
    try:
        with warnings.catch_warnings():  # fbgemm warns about optional SSD kernels it lacks
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
            from fbgemm_gpu import split_table_batched_embeddings_ops_training as tbe
    except Exception:  # ImportError, or "Could not load this library" on a torch mismatch
        return None
    return tbe


def fbgemm_available() -> bool:
    """True when fbgemm_gpu is installed and its operators load with this torch."""
    return _load() is not None


def fbgemm_tbe() -> ModuleType:
    """fbgemm's training TBE module (``SplitTableBatchedEmbeddingBagsCodegen`` ...)."""
    tbe = _load()
    if tbe is None:
        raise RuntimeError(
            "fbgemm_gpu is not available: install the build that matches torch 2.13 "
            "(`pip install lightning-shardrec[cpu]` or `[cuda]`), or use kernel='torch'"
        )
    return tbe


def fbgemm_ops_on(device: str) -> bool:
    """Whether the ``torch.ops.fbgemm`` sparse ops can run on tensors of ``device`` type.

    The CPU wheel registers CPU kernels only; CUDA tensors then take the torch path.
    """
    if not fbgemm_available():
        return False
    if device == "cpu":
        return True
    if device == "cuda":
        return _has_cuda_kernels()
    return False


@functools.cache
def _has_cuda_kernels() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        torch.ops.fbgemm.asynchronous_complete_cumsum(torch.zeros(1, dtype=torch.int64, device="cuda"))
    except Exception:
        return False
    return True


@functools.cache
def _load_inference() -> ModuleType | None:
    if _load() is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fbgemm_gpu import split_table_batched_embeddings_ops_inference as inference
    except Exception:
        return None
    return inference


def fbgemm_inference_available() -> bool:
    """True when fbgemm's integer inference TBE (``IntNBitTableBatchedEmbeddingBagsCodegen``) loads."""
    return _load_inference() is not None


def fbgemm_inference_tbe() -> ModuleType:
    """fbgemm's inference TBE module (``IntNBitTableBatchedEmbeddingBagsCodegen``, ``SparseType``,
    ``EmbeddingLocation``, ``PoolingMode``, ``BoundsCheckMode`` are all reachable from it)."""
    inference = _load_inference()
    if inference is None:
        raise RuntimeError(
            "fbgemm_gpu's inference TBE is not available: install the build that matches torch 2.13 "
            "(`pip install lightning-shardrec[cpu]` or `[cuda]`), or use backend='torch'"
        )
    return inference


def fbgemm_quantize_rows_nbit(weight: Tensor, bits: int) -> Tensor:
    """fbgemm's row-wise quantizer: ``[rows, dim]`` float -> ``[rows, dim*bits/8 + 4]`` uint8.

    Each row is ``| packed ints | scale fp16 | bias fp16 |``; element ``j`` sits in byte
    ``j // (8 // bits)`` at bit ``(j % (8 // bits)) * bits``.
    """
    fbgemm_inference_tbe()  # raises when absent; importing it registered the operators
    import torch

    return torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight, bits)
