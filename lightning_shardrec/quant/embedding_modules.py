"""TorchRec's quantized collections at their path (``torchrec.quant.embedding_modules``).

``EmbeddingBagCollection.from_float(module)`` reads the ``qconfig`` that
``torch.quantization.quantize_dynamic(module, qconfig_spec={EmbeddingBagCollection: QuantConfig(...)},
mapping={EmbeddingBagCollection: <this class>})`` set on the float collection, and returns a
:class:`~lightning_shardrec.inference.QuantEmbeddingBagCollection` of the storage type it names
(:mod:`lightning_shardrec.quant.torchrec_quant`); ``EmbeddingCollection.from_float`` does the same for
a sequence collection (:class:`~lightning_shardrec.inference.QuantEmbeddingCollection`). Built directly,
the classes take this library's arguments (``tables, dtype, ...``), not TorchRec's.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_shardrec.errors import missing_names
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection
from lightning_shardrec.inference.quant_embedding_collection import QuantEmbeddingCollection
from lightning_shardrec.inference.rowwise import QuantDType
from lightning_shardrec.modules import EmbeddingBagCollection as FloatEmbeddingBagCollection
from lightning_shardrec.modules import EmbeddingCollection as FloatEmbeddingCollection
from lightning_shardrec.quant.torchrec_quant import storage_of

#: the attribute ``quant_prep_enable_register_tbes`` sets (TorchRec's name)
MODULE_ATTR_REGISTER_TBES_BOOL = "__register_tbes_in_named_modules"


class EmbeddingBagCollection(QuantEmbeddingBagCollection):
    """The quantized ``EmbeddingBagCollection`` under TorchRec's name, for ``quantize_dynamic``'s mapping."""

    @classmethod
    def from_float(  # type: ignore[override]
        cls, module: FloatEmbeddingBagCollection, use_precomputed_fake_quant: bool = False
    ) -> EmbeddingBagCollection:
        """``module`` quantized as its ``qconfig`` says (set by ``quantize_dynamic``)."""
        tables = [t.name for t in module.embedding_bag_configs()]
        dtype = _qconfig_storage(module, "EmbeddingBagCollection", tables, "quantize_embeddings")
        return super().from_float(module, dtype)  # type: ignore[return-value]


class EmbeddingCollection(QuantEmbeddingCollection):
    """The quantized ``EmbeddingCollection`` under TorchRec's name, for ``quantize_dynamic``'s mapping."""

    @classmethod
    def from_float(  # type: ignore[override]
        cls, module: FloatEmbeddingCollection, use_precomputed_fake_quant: bool = False
    ) -> EmbeddingCollection:
        """``module`` quantized as its ``qconfig`` says (set by ``quantize_dynamic``)."""
        tables = [t.name for t in module.embedding_configs()]
        dtype = _qconfig_storage(module, "EmbeddingCollection", tables, "quantize_inference_model")
        return super().from_float(module, dtype)  # type: ignore[return-value]


def _qconfig_storage(module: nn.Module, kind: str, tables: list[str], entry: str) -> QuantDType:
    """The storage type the ``qconfig`` ``quantize_dynamic`` set on the float ``kind`` ``module`` names."""
    where = f"quant.embedding_modules.{kind}.from_float"
    qconfig = getattr(module, "qconfig", None)
    if qconfig is None:
        raise ValueError(
            f"{where}: the float {kind} has no qconfig; quantize it with torch.quantization.quantize_dynamic(..., "
            f"qconfig_spec={{{kind}: QuantConfig(...)}}) or lightning_shardrec.inference.modules.{entry}"
        )
    return storage_of(qconfig, tables, where)


def quant_prep_enable_register_tbes(module: nn.Module, module_types: Sequence[type[nn.Module]]) -> None:
    """Mark the collections of ``module_types`` as TorchRec does before quantizing. TorchRec then registers
    its fbgemm lookup modules as submodules; the lookups here hold no submodules, so the mark changes
    nothing (it is set, as TorchRec sets it)."""
    for m in module.modules():
        if isinstance(m, tuple(module_types)):
            setattr(m, MODULE_ATTR_REGISTER_TBES_BOOL, True)


__getattr__ = missing_names(
    __name__,
    {
        "FeatureProcessedEmbeddingBagCollection": "feature processors are not supported",
        "QuantManagedCollisionEmbeddingCollection": "managed-collision modules are not supported",
        "quant_prep_enable_quant_state_dict_split_scale_bias": "the state dict always splits scale and bias here",
        "quant_prep_enable_quant_state_dict_split_scale_bias_for_types": (
            "the state dict always splits scale and bias here"
        ),
        "quant_prep_customize_row_alignment": "rows are stored unpadded here",
    },
)

__all__ = [
    "MODULE_ATTR_REGISTER_TBES_BOOL",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "quant_prep_enable_register_tbes",
]
