"""Example inputs to trace a model for ``torch.export``: given by import path, or built for the library's models.

``shardrec export --format pt2|aoti`` traces the model once on example inputs. For
:class:`~lightning_shardrec.models.DLRM`, :class:`~lightning_shardrec.models.DCNv2` and
:class:`~lightning_shardrec.models.DLRMTask` they are built from the model itself (a batch of 4:
dense ``[4, D_in]`` and 0..3 ids per bag of every feature); any other model names a function
``--example pkg.module:fn`` returning its positional inputs (a tuple), e.g.::

    def example():
        return (torch.randn(4, 13), KeyedJaggedTensor(["user", "item"], ids, lengths=lengths))

Only shapes and dtypes matter (the batch size and id counts stay dynamic); ids must be valid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection
from lightning_shardrec.sparse import KeyedJaggedTensor

EXAMPLE_BATCH = 4


def resolve_example(target: str) -> tuple[Any, ...]:
    """Call ``pkg.module:fn`` and return its inputs as a tuple."""
    from lightning_shardrec.inference.export import _resolve

    made = _resolve(target)()
    return tuple(made) if isinstance(made, (tuple, list)) else (made,)


def default_example(model: nn.Module, where: str) -> tuple[Any, ...]:
    """Inputs of a (quantized) DLRM / DCNv2 / DLRMTask: ``(dense, kjt)``, or ``(RecBatch,)`` for a task."""
    core: Any = next((m for m in model.modules() if type(m).__name__ in ("DLRM", "DCNv2")), None)
    if core is None:
        raise ValueError(
            f"export: no example inputs for {where}: pass example_inputs (--example pkg.module:fn returning "
            "the model's positional inputs); they are built only for DLRM, DCNv2 and DLRMTask"
        )
    qebc = core.sparse_arch.embedding_bag_collection
    if not isinstance(qebc, QuantEmbeddingBagCollection):  # pragma: no cover - export quantizes first
        raise TypeError(f"export: expected a quantized collection, got {type(qebc).__name__}")
    dense = torch.randn(EXAMPLE_BATCH, core.dense_arch[0].in_features, generator=torch.Generator().manual_seed(0))
    kjt = example_kjt(qebc)
    if type(model).__name__ == "DLRMTask":
        return (RecBatch(dense, kjt, torch.zeros(EXAMPLE_BATCH)),)
    return (dense, kjt)


def example_kjt(qebc: QuantEmbeddingBagCollection, batch: int = EXAMPLE_BATCH) -> KeyedJaggedTensor:
    """0..3 valid ids per bag of each feature the collection reads (weighted when it is)."""
    rows = {f: t.num_embeddings for t in qebc.embedding_bag_configs() for f in t.feature_names}
    keys = list(rows)
    lengths = torch.arange(len(keys) * batch) % 4
    parts: list[Tensor] = []
    for k, key in enumerate(keys):
        n = int(lengths[k * batch : (k + 1) * batch].sum())
        parts.append(torch.arange(n) * 7 % rows[key])
    values = torch.cat(parts)
    weights = torch.rand(values.numel(), generator=torch.Generator().manual_seed(0)) if qebc.is_weighted() else None
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths)
