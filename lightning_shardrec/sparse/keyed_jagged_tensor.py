"""``KeyedJaggedTensor``: one JaggedTensor per key (feature), sharing one batch.

Lengths are key-major, exactly as TorchRec: all of key 0's bags, then key 1's::

    keys     ["product", "user"]          K = 2, stride (batch) B = 3
                 product        user
    bags     [[1, 2], [], [3]] [[4], [5], [6]]
    values   [1, 2, 3, 4, 5, 6]            [N] ids
    lengths  [2, 0, 1, 1, 1, 1]            [K * B]
    offsets  [0, 2, 2, 3, 4, 5, 6]         [K * B + 1]
    length_per_key  [3, 3]                 ids per key
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_shardrec.sparse import ops
from lightning_shardrec.sparse.jagged_tensor import JaggedTensor, _check_data, _check_shapes


class KeyedJaggedTensor:
    """Jagged bags for several keys: ``KeyedJaggedTensor(keys, values, weights, lengths, offsets, stride)``.

    Positional order matches TorchRec. ``stride`` (batch size) defaults to
    ``len(lengths) // len(keys)``. Shapes and dtypes are checked here, and so is the
    data of CPU tensors (negative lengths, offsets that disagree); for device tensors
    :meth:`validate` checks the data (reading it would sync with the device).
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
        stride: int | None = None,
        *,
        length_per_key: list[int] | None = None,
        offset_per_key: list[int] | None = None,
    ) -> None:
        keys = _check_keys(keys)
        where = f"KeyedJaggedTensor(keys={keys})"
        if lengths is None and offsets is None:
            raise ValueError(f"{where} needs lengths or offsets (got neither)")
        if not isinstance(values, Tensor):
            raise TypeError(f"{where}: values must be a torch.Tensor of ids, got {type(values).__name__}")
        if values.dim() != 1:
            raise ValueError(f"KeyedJaggedTensor values must be 1-D ids, got shape {tuple(values.shape)}")
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"KeyedJaggedTensor ids must be integers, got dtype {values.dtype} for keys {keys}")
        _check_shapes(values, weights, lengths, offsets, where=where)
        if weights is not None and (weights.dim() != 1 or not weights.is_floating_point()):
            raise ValueError(
                f"{where}: weights must be a 1-D float tensor (one per id), "
                f"got shape {tuple(weights.shape)} dtype {weights.dtype}"
            )
        num_bags = lengths.numel() if lengths is not None else offsets.numel() - 1  # type: ignore[union-attr]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedTensor keys must be unique, repeated: {dup}")
        int_like = isinstance(stride, (numbers.Integral, torch.SymInt)) and not isinstance(stride, bool)
        if stride is not None and (not int_like or stride < 0):
            raise ValueError(f"{where}: stride (batch size) must be an int >= 0, got {stride!r}")
        if stride is None:
            if not keys:
                if num_bags:
                    raise ValueError(f"KeyedJaggedTensor has no keys but {num_bags} lengths")
                stride = 0
            elif num_bags % len(keys):
                raise ValueError(
                    f"{num_bags} lengths do not divide into {len(keys)} keys {keys} "
                    "(lengths are key-major: len(keys) * batch_size entries)"
                )
            else:
                stride = num_bags // len(keys)
        elif stride * len(keys) != num_bags:
            raise ValueError(
                f"stride {stride} x {len(keys)} keys {keys} needs {stride * len(keys)} lengths, got {num_bags}"
            )
        stride = int(stride)
        if values.device.type == "cpu":  # host data: the full check is one cheap pass
            host_lengths = lengths if lengths is not None else offsets[1:] - offsets[:-1]  # type: ignore[index]
            _check_data(host_lengths, offsets, values.numel(), keys=keys, stride=stride, where=where)
            if length_per_key is not None and keys:
                actual = host_lengths.view(len(keys), stride).sum(1).tolist()
                if list(length_per_key) != actual:
                    raise ValueError(f"{where}: length_per_key {list(length_per_key)} but the lengths give {actual}")
        if length_per_key is not None or offset_per_key is not None:
            _check_per_key(keys, values.numel(), length_per_key, offset_per_key, where)
        self._init(keys, values, weights, lengths, offsets, stride, length_per_key, offset_per_key)

    def _init(
        self,
        keys: list[str],
        values: Tensor,
        weights: Tensor | None,
        lengths: Tensor | None,
        offsets: Tensor | None,
        stride: int,
        length_per_key: list[int] | None,
        offset_per_key: list[int] | None,
    ) -> None:
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._length_per_key = length_per_key
        self._offset_per_key = offset_per_key
        self._index_per_key: dict[str, int] | None = None

    @classmethod
    def _trusted(
        cls,
        keys: list[str],
        values: Tensor,
        weights: Tensor | None,
        lengths: Tensor,
        stride: int,
        length_per_key: list[int] | None = None,
    ) -> KeyedJaggedTensor:
        """Build from parts this library produced and already knows to be consistent."""
        kjt = cls.__new__(cls)
        kjt._init(keys, values, weights, lengths, None, stride, length_per_key, None)
        return kjt

    # --- alternative constructors ---------------------------------------------------
    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        kjt = KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=stride)
        kjt.length_per_key()
        return kjt

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Tensor,
        offsets: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        kjt = KeyedJaggedTensor(keys, values, weights, offsets=offsets, stride=stride)
        kjt.length_per_key()
        return kjt

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Stack per-key JaggedTensors (same batch size each) into one KJT."""
        if not jt_dict:
            return KeyedJaggedTensor.empty()
        batch = {k: jt.lengths().numel() for k, jt in jt_dict.items()}
        if len(set(batch.values())) != 1:
            raise ValueError(f"from_jt_dict needs one batch size for every key, got {batch}")
        jts = list(jt_dict.values())
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            missing = [k for k, w in zip(jt_dict, weighted, strict=True) if not w]
            raise ValueError(f"from_jt_dict: keys {missing} have no weights while others do")
        weights = torch.cat([jt.weights() for jt in jts]) if all(weighted) else None
        return KeyedJaggedTensor(
            list(jt_dict),
            torch.cat([jt.values() for jt in jts]),
            weights,
            lengths=torch.cat([jt.lengths() for jt in jts]),
        )

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of every KJT, in order, over one shared batch."""
        if not kjt_list:
            raise ValueError("KeyedJaggedTensor.concat needs at least one KJT")
        strides = {kjt.stride() for kjt in kjt_list if kjt.keys()}
        if len(strides) > 1:
            raise ValueError(f"KeyedJaggedTensor.concat needs one batch size, got strides {sorted(strides)}")
        weighted = {kjt.weights_or_none() is not None for kjt in kjt_list if kjt.keys()}
        if len(weighted) > 1:
            raise ValueError("KeyedJaggedTensor.concat cannot mix weighted and unweighted KJTs")
        keys = [k for kjt in kjt_list for k in kjt.keys()]  # noqa: SIM118 (a KJT, not a dict)
        # KJTs without keys hold no values, so they add no weights (and may have none).
        weights = None
        if weighted == {True}:
            weights = torch.cat([kjt.weights() for kjt in kjt_list if kjt.keys()])
        lpk = (
            [n for kjt in kjt_list for n in kjt.length_per_key()]
            if all(kjt._length_per_key is not None for kjt in kjt_list)
            else None
        )
        out = KeyedJaggedTensor(
            keys,
            torch.cat([kjt.values() for kjt in kjt_list]),
            weights,
            lengths=torch.cat([kjt.lengths() for kjt in kjt_list]),
            stride=strides.pop() if strides else kjt_list[0].stride(),
        )
        out._length_per_key = lpk
        return out

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype = torch.int64,
        weights_dtype: torch.dtype = torch.float32,
        lengths_dtype: torch.dtype = torch.int64,
    ) -> KeyedJaggedTensor:
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return KeyedJaggedTensor(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            weights,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
        )

    # --- accessors ----------------------------------------------------------------
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError(f"KeyedJaggedTensor(keys={self._keys}) has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def lengths(self) -> Tensor:
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]  # type: ignore[index]
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        return self._lengths

    def offsets(self) -> Tensor:
        if self._offsets is None:
            self._offsets = ops.complete_cumsum(self._lengths)  # type: ignore[arg-type]
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        return self._offsets

    def stride(self) -> int:
        """Batch size: bags per key."""
        return self._stride

    def device(self) -> torch.device:
        return self._values.device

    def variable_stride_per_key(self) -> bool:
        return False

    def length_per_key(self) -> list[int]:
        """Number of ids of each key (one host sync, cached)."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            else:
                self._length_per_key = self.lengths().view(len(self._keys), self._stride).sum(1).tolist()
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Start of each key's ids in ``values()``, plus the total: ``[K + 1]``."""
        if self._offset_per_key is None:
            out = [0]
            for n in self.length_per_key():
                out.append(out[-1] + n)
            self._offset_per_key = out
        return self._offset_per_key

    def _key_index(self, key: str) -> int:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        try:
            return self._index_per_key[key]
        except KeyError:
            raise KeyError(f"key '{key}' not in KeyedJaggedTensor keys {self._keys}") from None

    def __getitem__(self, key: str) -> JaggedTensor:
        i = self._key_index(key)
        start, end = self.offset_per_key()[i], self.offset_per_key()[i + 1]
        lengths = self.lengths()[i * self._stride : (i + 1) * self._stride]
        weights = None if self._weights is None else self._weights[start:end]
        out = JaggedTensor.__new__(JaggedTensor)
        out._values, out._weights, out._lengths, out._offsets = self._values[start:end], weights, lengths, None
        return out

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    # --- reshaping ----------------------------------------------------------------
    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of keys: ``segments`` are key counts summing to ``len(keys)``."""
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(f"split segments {list(segments)} must be non-negative and sum to {len(self._keys)} keys")
        opk, out, k = self.offset_per_key(), [], 0
        lpk = self.length_per_key()
        for seg in segments:
            start, end = opk[k], opk[k + seg]
            out.append(
                KeyedJaggedTensor._trusted(
                    self._keys[k : k + seg],
                    self._values[start:end],
                    None if self._weights is None else self._weights[start:end],
                    self.lengths()[k * self._stride : (k + seg) * self._stride],
                    self._stride,
                    lpk[k : k + seg],
                )
            )
            k += seg
        return out

    def permute(self, indices: Sequence[int], indices_tensor: Tensor | None = None) -> KeyedJaggedTensor:
        """New key order: key ``j`` of the result is key ``indices[j]`` (keys may repeat or drop)."""
        bad = [i for i in indices if not 0 <= i < len(self._keys)]
        if bad:
            raise ValueError(f"permute indices {bad} outside [0, {len(self._keys)}) for keys {self._keys}")
        keys = [self._keys[i] for i in indices]
        lpk = self.length_per_key()
        new_lpk = [lpk[i] for i in indices]
        if indices_tensor is None:
            indices_tensor = torch.tensor(list(indices), dtype=torch.long, device=self.device())
        lengths, values, weights = ops.permute_2d(
            indices_tensor,
            self.lengths().view(len(self._keys), self._stride),
            self._values,
            self._weights,
            permuted_values_numel=sum(new_lpk),
        )
        return KeyedJaggedTensor._trusted(keys, values, weights, lengths.reshape(-1), self._stride, new_lpk)

    # --- movement -----------------------------------------------------------------
    def _map(self, fn) -> KeyedJaggedTensor:  # type: ignore[no-untyped-def]
        out = KeyedJaggedTensor.__new__(KeyedJaggedTensor)
        out._init(
            self._keys,
            fn(self._values),
            None if self._weights is None else fn(self._weights),
            None if self._lengths is None else fn(self._lengths),
            None if self._offsets is None else fn(self._offsets),
            self._stride,
            self._length_per_key,
            self._offset_per_key,
        )
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KeyedJaggedTensor:
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)  # type: ignore[arg-type]

    def sync(self) -> KeyedJaggedTensor:
        """Compute and cache ``length_per_key`` now (TorchRec API)."""
        self.offset_per_key()
        return self

    # --- checks -------------------------------------------------------------------
    def validate(self) -> None:
        """Full data checks: negative lengths, offsets vs lengths, totals, named by key."""
        lengths = self._lengths if self._lengths is not None else self.lengths()
        offsets = self._offsets if self._lengths is not None else None
        where = f"KeyedJaggedTensor(keys={self._keys})"
        _check_data(lengths, offsets, self._values.numel(), keys=self._keys, stride=self._stride, where=where)
        if self._weights is not None and self._weights.numel() != self._values.numel():
            raise ValueError(f"{where}: {self._weights.numel()} weights for {self._values.numel()} values")

    def __repr__(self) -> str:
        if not self._keys:
            return f"KeyedJaggedTensor(keys=[], stride={self._stride})"
        lines = [f"KeyedJaggedTensor(stride={self._stride}, keys={self._keys})"]
        if self._values.device.type == "meta":  # no data to show
            lines.append(f"  values={self._values}, lengths={self.lengths()}")
            return "\n".join(lines)
        for k in self._keys:
            jt = self[k]
            w = f", weights={jt.weights().tolist()}" if self._weights is not None else ""
            bags = [b.tolist() for b in jt.to_dense()] if jt.values().numel() <= 64 else "..."
            lines.append(f"  '{k}': {bags}{w}")
        return "\n".join(lines)


def _check_keys(keys: object) -> list[str]:
    """``keys`` as a list of str; a bare string or non-str keys are a ``TypeError``."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"KeyedJaggedTensor keys must be a list of feature names, got {keys!r}")
    out = list(keys)
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise TypeError(f"KeyedJaggedTensor keys must be str, got {bad} in {out}")
    return out


def _check_per_key(
    keys: list[str], num_values: int, length_per_key: list[int] | None, offset_per_key: list[int] | None, where: str
) -> None:
    """Caller-given per-key totals must match the keys and the number of ids."""
    if length_per_key is not None:
        lpk = list(length_per_key)
        if len(lpk) != len(keys) or any(n < 0 for n in lpk) or sum(lpk) != num_values:
            raise ValueError(
                f"{where}: length_per_key {lpk} needs one count >= 0 per key ({len(keys)}) "
                f"summing to the {num_values} ids"
            )
    if offset_per_key is not None:
        opk = list(offset_per_key)
        ok = len(opk) == len(keys) + 1 and opk[0] == 0 and opk[-1] == num_values
        if not ok or any(b < a for a, b in zip(opk, opk[1:], strict=False)):
            raise ValueError(
                f"{where}: offset_per_key {opk} needs {len(keys) + 1} non-decreasing entries from 0 to {num_values}"
            )
        if length_per_key is not None and [b - a for a, b in zip(opk, opk[1:], strict=False)] != list(length_per_key):
            raise ValueError(f"{where}: offset_per_key {opk} disagrees with length_per_key {list(length_per_key)}")
