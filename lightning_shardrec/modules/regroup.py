"""``KTRegroupAsDict`` at TorchRec's path (``torchrec.modules.regroup``): ``KeyedTensor.regroup_as_dict`` as a module.

::

    regroup = KTRegroupAsDict(groups=[["f1", "f2"], ["f3"]], keys=["user", "object"])
    out = regroup([kt_a, kt_b])       # {"user": [B, d1 + d2], "object": [B, d3]}
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_shardrec.configs import DataType
from lightning_shardrec.modules.embedding_configs import data_type_to_dtype
from lightning_shardrec.sparse.keyed_tensor import KeyedTensor


class KTRegroupAsDict(nn.Module):
    """One ``[B, sum of dims]`` tensor per output key: group ``i``'s features, from whichever KeyedTensor holds
    them, concatenated in order (a feature may appear in several groups, or in none). ``emb_dtype`` casts the
    outputs. Gradients flow back to the inputs' values. ``multi_device`` is TorchRec's and changes nothing here
    (no cached index tensors to move)."""

    def __init__(
        self, groups: list[list[str]], keys: list[str], emb_dtype: DataType | None = None, multi_device: bool = False
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(f"KTRegroupAsDict: {len(groups)} groups but {len(keys)} keys; give one key per group")
        self._groups = [list(g) for g in groups]
        self._keys = list(keys)
        self._emb_dtype = emb_dtype
        self._dtype = None if emb_dtype is None else data_type_to_dtype(emb_dtype)

    def forward(self, keyed_tensors: list[KeyedTensor]) -> dict[str, torch.Tensor]:
        out = KeyedTensor.regroup_as_dict(keyed_tensors, self._groups, self._keys)
        if self._dtype is None:
            return out
        return {k: v.to(self._dtype) for k, v in out.items()}

    def clear_cache(self) -> None:
        """TorchRec's ``CacheMixin``: nothing is cached here (the grouping is computed per call)."""


__all__ = ["KTRegroupAsDict"]
