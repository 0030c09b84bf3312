"""Quantized inference: row-wise int8/int4/fp16 tables on fbgemm's integer TBE (torch fallback).

* :func:`quantize` swaps each ``EmbeddingBagCollection`` for a
  :class:`QuantEmbeddingBagCollection` (same ``forward(kjt) -> KeyedTensor``);
  :class:`QuantEmbeddingCollection` is the sequence counterpart (``from_float``, and TorchRec's
  ``quantize_inference_model``).
* :mod:`lightning_shardrec.inference.export` writes/reads a serving artifact
  (``export``/``load`` here as :func:`export_model`/:func:`load`; CLI
  ``python -m lightning_shardrec.inference.export``).
* ``QuantizedPredictor`` (imported lazily: it needs Lightning) runs a plain
  quantized module under ``Trainer.predict``.
* :func:`export_program` (:mod:`~lightning_shardrec.inference.program`) traces a quantized
  model into a ``torch.export`` program of aten ops (``ServingEmbeddingBags`` for the
  collections), which loads with torch alone (``shardrec export --format pt2|aoti``).
"""

from lightning_shardrec.inference.export import export as export_model  # the name `export` stays the module
from lightning_shardrec.inference.export import load
from lightning_shardrec.inference.lookup import QuantBackend
from lightning_shardrec.inference.program import export_program
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection
from lightning_shardrec.inference.quant_embedding_collection import QuantEmbeddingCollection
from lightning_shardrec.inference.quant_plain import QuantEmbedding, QuantEmbeddingBag
from lightning_shardrec.inference.quantize import quantize, quantize_dense
from lightning_shardrec.inference.rowwise import (
    QuantDType,
    QuantizedRows,
    dequantize_rows,
    quantize_rows,
    row_error_bound,
)
from lightning_shardrec.inference.serving_ebc import ServingEmbeddingBags


def __getattr__(name: str) -> object:
    if name == "modules":  # TorchRec's ``torchrec.inference.modules`` (``trec_infer.modules.quantize_embeddings``)
        import importlib

        return importlib.import_module("lightning_shardrec.inference.modules")
    if name == "QuantizedPredictor":
        from lightning_shardrec.lightning.reports.predictor import QuantizedPredictor

        return QuantizedPredictor
    raise AttributeError(f"module 'lightning_shardrec.inference' has no attribute {name!r}")


__all__ = [
    "QuantBackend",
    "QuantDType",
    "QuantEmbedding",
    "QuantEmbeddingBag",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "QuantizedPredictor",
    "QuantizedRows",
    "ServingEmbeddingBags",
    "dequantize_rows",
    "export_model",
    "export_program",
    "load",
    "quantize",
    "quantize_dense",
    "quantize_rows",
    "row_error_bound",
]
