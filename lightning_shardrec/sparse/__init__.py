"""Sparse batch types: jagged bags of ids and keyed pooled embeddings (TorchRec's names)."""

from lightning_shardrec.sparse import pytree as _pytree
from lightning_shardrec.sparse.equality import jt_is_equal, kjt_is_equal, regroup_kts
from lightning_shardrec.sparse.errors import JaggedAssertionError, JaggedIndexError
from lightning_shardrec.sparse.jagged_tensor import JaggedTensor
from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from lightning_shardrec.sparse.keyed_tensor import KeyedTensor

_pytree.register()

__all__ = [
    "JaggedAssertionError",
    "JaggedIndexError",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "jt_is_equal",
    "kjt_is_equal",
    "regroup_kts",
]
