"""TorchRec's modules that convert between a ``KeyedJaggedTensor`` and a dict of ``JaggedTensor``."""

from __future__ import annotations

from torch import nn

from lightning_shardrec.sparse.jagged_tensor import JaggedTensor
from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor


class ComputeKJTToJTDict(nn.Module):
    """``forward(kjt)`` -> ``kjt.to_dict()``: key -> its ``JaggedTensor``."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(nn.Module):
    """``forward(jt_dict)`` -> ``KeyedJaggedTensor.from_jt_dict(jt_dict)``: the keys in the dict's order."""

    def forward(self, jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)


__all__ = ["ComputeJTDictToKJT", "ComputeKJTToJTDict"]
