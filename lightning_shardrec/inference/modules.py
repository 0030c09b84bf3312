"""TorchRec's ``torchrec.inference.modules``: quantize a model's embedding collections.

* :func:`quantize_embeddings`: the same call and result as TorchRec's: ``quantize_dynamic`` with a
  :class:`QuantConfig` of ``dtype`` weights and ``output_dtype`` outputs for each
  ``EmbeddingBagCollection`` (and the ``additional_*`` types), swapped for
  :mod:`lightning_shardrec.quant.embedding_modules`' classes.
* :func:`quantize_inference_model`: TorchRec's entry point: every module whose type
  ``quantization_mapping`` names (by default both collections, :data:`DEFAULT_QUANT_MAPPING`) quantized
  to ``quantization_dtype`` (int8 by default), ``per_table_weight_dtype`` per table.

The supported dtypes are listed in :mod:`lightning_shardrec.quant.torchrec_quant`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.ao.quantization import PlaceholderObserver, quantize_dynamic

from lightning_shardrec.errors import missing_names
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.modules.embedding_configs import QuantConfig
from lightning_shardrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from lightning_shardrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection


def trim_torch_package_prefix_from_typename(typename: str) -> str:
    """``torch.typename`` of a class loaded from a ``torch.package`` without its ``<torch_package_N>.`` head."""
    return ".".join(typename.split(".")[1:]) if typename.startswith("<torch_package_") else typename


#: TorchRec's default: the float collections' type names -> their quantized classes
DEFAULT_QUANT_MAPPING: dict[str, type[nn.Module]] = {
    trim_torch_package_prefix_from_typename(torch.typename(EmbeddingBagCollection)): QuantEmbeddingBagCollection,
    trim_torch_package_prefix_from_typename(torch.typename(EmbeddingCollection)): QuantEmbeddingCollection,
}
#: TorchRec's default storage type of the tables
DEFAULT_QUANTIZATION_DTYPE: torch.dtype = torch.int8


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


def quantize_inference_model(
    model: nn.Module,
    quantization_mapping: dict[str, type[nn.Module]] | None = None,
    per_table_weight_dtype: dict[str, torch.dtype] | None = None,
    fp_weight_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    quantization_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    output_dtype: torch.dtype = torch.float,
) -> nn.Module:
    """``model`` (in place) with each module whose type ``quantization_mapping`` names (``torch.typename``
    strings, TorchRec's or this library's module path) swapped for its quantized class.
    ``fp_weight_dtype`` is TorchRec's setting for feature-processed collections, which do not exist here."""
    mapped = _types_of(DEFAULT_QUANT_MAPPING if quantization_mapping is None else quantization_mapping)
    found = {type(m): mapped[type(m)] for m in model.modules() if type(m) in mapped}
    return quantize_embeddings(
        model,
        dtype=quantization_dtype,
        inplace=True,
        additional_qconfig_spec_keys=list(found),
        additional_mapping=found,
        output_dtype=output_dtype,
        per_table_weight_dtype=per_table_weight_dtype,
    )


def _types_of(mapping: Mapping[str, type[nn.Module]]) -> dict[type[nn.Module], type[nn.Module]]:
    """The classes a mapping's type names name (a name that names no class: a ``ValueError``)."""
    out: dict[type[nn.Module], type[nn.Module]] = {}
    for name, quant in mapping.items():
        path, _, attr = trim_torch_package_prefix_from_typename(name).rpartition(".")
        try:
            cls = getattr(importlib.import_module(path), attr)
        except (ImportError, AttributeError, ValueError):
            raise ValueError(
                f"quantize_inference_model: quantization_mapping names {name!r}, which is no class "
                "(use torch.typename(cls) of the module type to quantize)"
            ) from None
        out[cls] = quant
    return out


__getattr__ = missing_names(
    __name__,
    {
        "PredictFactory": "serve with lightning_shardrec.inference.export / load (see docs/migrating.md)",
        "PredictModule": "serve with lightning_shardrec.inference.export / load (see docs/migrating.md)",
        "shard_quant_model": "quantized collections serve whole on each process here",
        "DEFAULT_SHARDERS": "the quantized sharders are not provided: quantized collections serve whole",
        "DEFAULT_FUSED_PARAMS": "the quantized sharders' fused params are not provided: quantized collections serve "
        "whole",
    },
)

__all__ = [
    "DEFAULT_QUANTIZATION_DTYPE",
    "DEFAULT_QUANT_MAPPING",
    "quantize_embeddings",
    "quantize_inference_model",
    "trim_torch_package_prefix_from_typename",
]
