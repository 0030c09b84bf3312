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

# fbgemm-gpu ships one build per torch minor (fbgemm's own table). Checked here: 2.13 and 2.14
# pass the suite with their build, 2.11's loads (docs/install.md). The install extras in
# pyproject.toml name the same pairs; any other torch runs the portable backend.
FBGEMM_PAIRS: dict[str, str] = {"2.11": "1.6.0", "2.12": "1.7.0", "2.13": "1.8.0", "2.14": "1.9.0"}
_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu")


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
            f"fbgemm_gpu is not available ({describe()}); {_install_hint()}, or use kernel='torch'"
        )
    return tbe


def _torch_minor() -> str:
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def installed_build() -> str | None:
    """``"fbgemm-gpu-cpu 1.9.0"``: the installed fbgemm distribution, read without importing it; None if none."""
    from importlib import metadata

    for name in _DISTRIBUTIONS:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def describe() -> str:
    """One line: the fbgemm build, whether it loaded with this torch, and the backend that runs.

    e.g. ``"fbgemm-gpu-cpu 1.9.0 loaded with torch 2.14.1: fbgemm kernels"`` or
    ``"no fbgemm-gpu installed (torch 2.11.0): portable backend"``.
    """
    import torch

    build, where = installed_build(), f"torch {torch.__version__}"
    if os.environ.get(_DISABLE_ENV, "0") not in ("", "0"):
        return f"{build or 'no fbgemm-gpu'} switched off by {_DISABLE_ENV}: portable backend"
    if build is None:
        return f"no fbgemm-gpu installed ({where}): portable backend"
    if fbgemm_available():
        return f"{build} loaded with {where}: fbgemm kernels"
    return f"{build} does not load with {where}: portable backend"


def _install_hint() -> str:
    pair = FBGEMM_PAIRS.get(_torch_minor())
    if pair is None:
        known = ", ".join(f"torch {t} <-> {v}" for t, v in FBGEMM_PAIRS.items())
        return f"no fbgemm-gpu build is paired with torch {_torch_minor()} here (pairs: {known})"
    minor = _torch_minor()
    extra = f"torch{minor.replace('.', '')}-cpu"
    return f"install fbgemm-gpu(-cpu)=={pair}, the build for torch {minor} (`pip install lightning-shardrec[{extra}]`)"


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
            f"fbgemm_gpu's inference TBE is not available ({describe()}); {_install_hint()}, or use backend='torch'"
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
