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
