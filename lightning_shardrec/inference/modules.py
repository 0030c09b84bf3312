"""TorchRec's ``torchrec.inference.modules.quantize_embeddings``: quantize every ``EmbeddingBagCollection``.

The same call and result as TorchRec's: ``quantize_dynamic`` with a :class:`QuantConfig` of ``dtype``
weights and ``output_dtype`` outputs for each collection, swapped for
:class:`lightning_shardrec.quant.embedding_modules.EmbeddingBagCollection`. The supported dtypes are
listed in :mod:`lightning_shardrec.inference.torchrec_quant`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.ao.quantization import PlaceholderObserver, quantize_dynamic

from lightning_shardrec.errors import missing_names
from lightning_shardrec.modules import EmbeddingBagCollection
from lightning_shardrec.modules.embedding_configs import QuantConfig
from lightning_shardrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection


def quantize_embeddings(
    module: nn.Module,
    dtype: torch.dtype,
    inplace: bool,
    additional_qconfig_spec_keys: Sequence[type[nn.Module]] | None = None,
    additional_mapping: Mapping[type[nn.Module], type[nn.Module]] | None = None,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: Mapping[str, torch.dtype] | None = None,
) -> nn.Module:
    """``module`` with each ``EmbeddingBagCollection`` quantized to ``dtype`` (``inplace=False``: a copy)."""
    qconfig = QuantConfig(
        activation=PlaceholderObserver.with_args(dtype=output_dtype),
        weight=PlaceholderObserver.with_args(dtype=dtype),
        per_table_weight_dtype=dict(per_table_weight_dtype) if per_table_weight_dtype else None,
    )
    spec: dict[type[nn.Module], QuantConfig] = {EmbeddingBagCollection: qconfig}
    spec.update((t, qconfig) for t in additional_qconfig_spec_keys or ())
    mapping: dict[type[nn.Module], type[nn.Module]] = {EmbeddingBagCollection: QuantEmbeddingBagCollection}
    mapping.update(additional_mapping or {})
    return quantize_dynamic(module, qconfig_spec=spec, mapping=mapping, inplace=inplace)  # type: ignore[arg-type]


__getattr__ = missing_names(
    __name__,
    {
        "PredictFactory": "serve with lightning_shardrec.inference.export / load (see docs/migrating.md)",
        "PredictModule": "serve with lightning_shardrec.inference.export / load (see docs/migrating.md)",
        "shard_quant_model": "quantized collections serve whole on each process here",
    },
)

__all__ = ["quantize_embeddings"]
