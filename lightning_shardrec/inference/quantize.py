"""``quantize(module, dtype)``: swap every EmbeddingBagCollection and EmbeddingCollection for a quantized one.

The module may be a trained model, an unsharded model that loaded a checkpoint
written by the ``shardrec`` strategy (its state dict is the full, gathered one),
or an ``EmbeddingBagCollection`` itself. Dense layers stay fp32 unless
``dense=True`` runs ``torch.ao.quantization.quantize_dynamic`` (int8 weights,
dynamically quantized activations) on every ``nn.Linear``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_shardrec.inference.lookup import QuantBackend
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection
from lightning_shardrec.inference.quant_embedding_collection import QuantEmbeddingCollection
from lightning_shardrec.inference.quant_plain import quantize_plain
from lightning_shardrec.inference.rowwise import QuantDType
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection


def quantize(
    module: nn.Module,
    dtype: str | QuantDType = QuantDType.INT8,
    *,
    dense: bool = False,
    backend: str | QuantBackend = QuantBackend.AUTO,
    inplace: bool = True,
) -> nn.Module:
    """Return ``module`` with each ``EmbeddingBagCollection`` replaced by a
    :class:`QuantEmbeddingBagCollection` of ``dtype`` (``"int8"``, ``"int4"``, ``"fp16"``),
    each ``EmbeddingCollection`` by a :class:`QuantEmbeddingCollection`, and each plain
    ``nn.Embedding``/``nn.EmbeddingBag`` by a
    :class:`~lightning_shardrec.inference.quant_plain.QuantEmbedding`/``QuantEmbeddingBag``.

    ``dense=True`` also quantizes ``nn.Linear`` layers dynamically (int8).
    ``backend`` picks the pooled lookup kernel (``"auto"``, ``"fbgemm"``, ``"torch"``; sequence
    tables gather in plain aten).
    ``inplace=False`` quantizes a deep copy and leaves ``module`` untouched.
    """
    qdtype, qbackend = QuantDType.parse(dtype), QuantBackend.parse(backend)
    if not inplace:
        module = copy.deepcopy(module)
    module = swap_collections(
        module, lambda _path, ebc: QuantEmbeddingBagCollection.from_float(ebc, qdtype, backend=qbackend)
    )
    module = swap_collections(
        module, lambda _path, ec: QuantEmbeddingCollection.from_float(ec, qdtype), EmbeddingCollection
    )
    quantize_plain(module, qdtype)
    if dense:
        module = quantize_dense(module)
    return module.eval()


def swap_collections(
    module: nn.Module, make: Callable[[str, Any], nn.Module], kind: type[nn.Module] = EmbeddingBagCollection
) -> nn.Module:
    """Replace every ``kind`` (an ``EmbeddingBagCollection`` unless given) in ``module`` (or ``module``
    itself, path ``""``) by ``make(path, collection)``."""
    if isinstance(module, kind):
        return make("", module)
    targets = [name for name, m in module.named_modules() if isinstance(m, kind)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, make(name, parent.get_submodule(child)))  # type: ignore[arg-type]
    return module


def collection_paths(module: nn.Module) -> list[str]:
    """Dotted paths of the (quantized or not) embedding bag collections in ``module`` ("" = itself)."""
    kinds = (EmbeddingBagCollection, QuantEmbeddingBagCollection)
    return [name for name, m in module.named_modules() if isinstance(m, kinds)]


def sequence_collection_paths(module: nn.Module) -> list[str]:
    """Dotted paths of the (quantized or not) embedding collections in ``module`` ("" = itself)."""
    kinds = (EmbeddingCollection, QuantEmbeddingCollection)
    return [name for name, m in module.named_modules() if isinstance(m, kinds)]


def quantize_dense(module: nn.Module) -> nn.Module:
    """``torch.ao`` dynamic int8 quantization of every ``nn.Linear`` (in place)."""
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao, still works
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)
