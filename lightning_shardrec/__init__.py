"""lightning_shardrec: TorchRec-style embedding sharding as a PyTorch Lightning strategy."""

from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__version__ = "0.1.0"

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "__version__"]
