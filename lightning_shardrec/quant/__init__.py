"""TorchRec's ``torchrec.quant``: the quantized ``EmbeddingBagCollection`` under its TorchRec name."""

from lightning_shardrec.quant.embedding_modules import EmbeddingBagCollection

__all__ = ["EmbeddingBagCollection"]
