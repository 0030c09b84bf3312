"""``KeyedTensor``: pooled embeddings of several keys side by side in one tensor.

::

    keys            ["user", "item"]
    length_per_key  [2, 3]                 (embedding dims)
    values          [B, 5]  = [ user(2) | item(3) ]
"""

import numbers
from typing import Dict, List, Optional

import torch
from torch import Tensor

from lightning_shardrec.sparse import formatting
from lightning_shardrec.sparse.fx_proxy import ProxyableConstruction, _tracer_of


class KeyedTensor(metaclass=ProxyableConstruction):
    """``KeyedTensor(keys, length_per_key, values, key_dim=1)``: ``values`` is ``[B, sum(dims)]``."""

    def __init__(
        self,
        keys: List[str],
        length_per_key: List[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Optional[List[int]] = None,
        index_per_key: Optional[Dict[str, int]] = None,
    ) -> None:
        if not isinstance(values, Tensor):
            raise TypeError(f"KeyedTensor: values must be a torch.Tensor, got {type(values).__name__}")
        keys, length_per_key = list(keys), list(length_per_key)
        if not _is_int(key_dim) or key_dim < 0:
            raise ValueError(f"KeyedTensor: key_dim must be an int >= 0, got {key_dim!r}")
        bad = {k: n for k, n in zip(keys, length_per_key, strict=False) if not _is_int(n) or n < 0}
        if bad:
            raise ValueError(f"KeyedTensor: length_per_key must be ints >= 0, got {bad}")
        if len(keys) != len(length_per_key):
            raise ValueError(f"KeyedTensor: {len(keys)} keys but {len(length_per_key)} lengths")
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedTensor keys must be unique, repeated: {dup}")
        no_data = not keys and values.numel() == 0  # TorchRec's KeyedTensor([], [], torch.Tensor())
        if not no_data and (values.dim() <= key_dim or values.shape[key_dim] != sum(length_per_key)):
            raise ValueError(
                f"KeyedTensor: length_per_key {length_per_key} sums to {sum(length_per_key)} "
                f"but values has shape {tuple(values.shape)} (key_dim={key_dim})"
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offsets: list[int] | None = None
        self._index: dict[str, int] | None = None
        if offset_per_key is not None and list(offset_per_key) != self.offset_per_key():
            raise ValueError(
                f"KeyedTensor: offset_per_key {list(offset_per_key)} but length_per_key gives {self.offset_per_key()}"
            )
        if index_per_key is not None and dict(index_per_key) != {k: i for i, k in enumerate(keys)}:
            raise ValueError(f"KeyedTensor: index_per_key {dict(index_per_key)} disagrees with keys {keys}")

    @staticmethod
    def from_tensor_list(
        keys: List[str], tensors: List[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> "KeyedTensor":
        return KeyedTensor(keys, [t.shape[key_dim] for t in tensors], torch.cat(list(tensors), cat_dim), key_dim)

    def _key_indices(self) -> dict[str, int]:
        """Key -> its position (TorchRec's)."""
        return {k: i for i, k in enumerate(self.keys())}

    def wait(self) -> "KeyedTensor":
        """TorchRec's awaitable protocol: a sharded collection's output is already computed here."""
        return self

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def size_in_bytes(self) -> int:
        """Bytes of its values tensor (the keys' lengths are Python ints), as TorchRec."""
        return self._values.numel() * self._values.element_size()

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offsets is None:
            out = [0]
            for n in self._length_per_key:
                out.append(out[-1] + n)
            self._offsets = out
        return self._offsets

    def __getitem__(self, key: str) -> Tensor:
        if self._index is None:
            self._index = {k: i for i, k in enumerate(self._keys)}
        if key not in self._index:
            raise KeyError(f"key '{key}' not in KeyedTensor keys {self._keys}")
        i = self._index[key]
        start = self.offset_per_key()[i]
        return self._values.narrow(self._key_dim, start, self._length_per_key[i])

    def to_dict(self) -> dict[str, Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, parts, strict=True))

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(
            self._keys, self._length_per_key, self._values.to(device, non_blocking=non_blocking), self._key_dim
        )

    def record_stream(self, stream: torch.cuda.streams.Stream) -> None:
        self._values.record_stream(stream)  # type: ignore[arg-type]

    @staticmethod
    def regroup(keyed_tensors: List["KeyedTensor"], groups: List[List[str]]) -> List[torch.Tensor]:
        """One tensor per group: the named keys' columns, from whichever KeyedTensor holds them."""
        if (tracer := _tracer_of((keyed_tensors, groups), {})) is not None:  # fx: one node, as TorchRec's
            return tracer.create_proxy("call_function", KeyedTensor.regroup, (keyed_tensors, groups), {})
        where: dict[str, Tensor] = {}
        for kt in keyed_tensors:
            if kt.key_dim() != 1:
                raise ValueError("KeyedTensor.regroup supports key_dim=1 only")
            where.update(kt.to_dict())
        missing = sorted({k for g in groups for k in g if k not in where})
        if missing:
            raise KeyError(f"regroup: keys {missing} are in none of the KeyedTensors (have {sorted(where)})")
        return [torch.cat([where[k] for k in g], dim=1) for g in groups]

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: List["KeyedTensor"], groups: List[List[str]], keys: List[str]
    ) -> Dict[str, torch.Tensor]:
        if (tracer := _tracer_of((keyed_tensors, groups, keys), {})) is not None:
            return tracer.create_proxy("call_function", KeyedTensor.regroup_as_dict, (keyed_tensors, groups, keys), {})
        if len(groups) != len(keys):
            raise ValueError(f"regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    def __str__(self) -> str:
        """TorchRec's layout: ``KeyedTensor({"key": [[row], ...], ...})``."""
        return formatting.keyed_tensor_str(self)

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, "
            f"values=[{', '.join(map(str, self._values.shape))}])"
        )


def _is_int(n: object) -> bool:
    """An int (numpy and symbolic ints included, as traced shapes are), not a bool."""
    return isinstance(n, (numbers.Integral, torch.SymInt)) and not isinstance(n, bool)
