"""Sparse batch types: jagged bags of ids and keyed pooled embeddings (TorchRec's names)."""

from lightning_shardrec.sparse.jagged_tensor import JaggedTensor
from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from lightning_shardrec.sparse.keyed_tensor import KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
