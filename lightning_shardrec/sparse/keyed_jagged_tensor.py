"""``KeyedJaggedTensor``: one JaggedTensor per key (feature), sharing one batch.

Lengths are key-major, exactly as TorchRec: all of key 0's bags, then key 1's::

    keys     ["product", "user"]          K = 2, stride (batch) B = 3
                 product        user
    bags     [[1, 2], [], [3]] [[4], [5], [6]]
    values   [1, 2, 3, 4, 5, 6]            [N] ids
    lengths  [2, 0, 1, 1, 1, 1]            [K * B]
    offsets  [0, 2, 2, 3, 4, 5, 6]         [K * B + 1]
    length_per_key  [3, 3]                 ids per key

With a variable batch per key (VBE, ``stride_per_key_per_rank``) key ``k`` has
``stride_per_key()[k]`` bags instead of ``stride`` (see :mod:`.kjt_checks`).
"""

from collections.abc import Callable
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lightning_shardrec.sparse import formatting, kjt_ops, ops
from lightning_shardrec.sparse.device_copy import mover
from lightning_shardrec.sparse.errors import JaggedAssertionError
from lightning_shardrec.sparse.fx_proxy import ProxyableConstruction
from lightning_shardrec.sparse.jagged_tensor import JaggedTensor, _check_data, _check_weights_count
from lightning_shardrec.sparse.kjt_checks import check_kjt_args, check_per_key, segment_sums, stride_per_key_of


class KeyedJaggedTensor(metaclass=ProxyableConstruction):
    """Jagged bags for several keys: ``KeyedJaggedTensor(keys, values, weights, lengths, offsets, stride, ...)``.

    Positional order matches TorchRec. ``stride`` (batch size) defaults to
    ``len(lengths) // len(keys)``. ``stride_per_key_per_rank`` (``[K][R]``) makes the
    batch variable per key; ``inverse_indices=(keys, tensor [len(keys), B])`` maps
    each of the ``B`` samples to its (deduplicated) bag, for expanding outputs.
    Shapes and dtypes are checked here, and so is the data of CPU tensors (negative
    lengths, offsets that disagree); for device tensors :meth:`validate` checks the
    data (reading it would sync with the device).
    """

    def __init__(
        self,
        keys: List[str],
        values: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[Union[List[List[int]], torch.IntTensor]] = None,
        stride_per_key: Optional[List[int]] = None,
        length_per_key: Optional[List[int]] = None,
        lengths_offset_per_key: Optional[List[int]] = None,
        offset_per_key: Optional[List[int]] = None,
        index_per_key: Optional[Dict[str, int]] = None,
        jt_dict: Optional[Dict[str, JaggedTensor]] = None,
        inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None,
    ) -> None:
        args = check_kjt_args(
            keys, values, weights, lengths, offsets, stride, stride_per_key_per_rank, inverse_indices, length_per_key
        )
        keys, lengths, offsets, stride, spkpr, inverse = args
        where = f"KeyedJaggedTensor(keys={keys})"
        if length_per_key is not None or offset_per_key is not None:
            check_per_key(keys, values.shape[0], length_per_key, offset_per_key, where)
        self._init(keys, values, weights, lengths, offsets, stride, length_per_key, offset_per_key, spkpr, inverse)
        given = {"stride_per_key": stride_per_key, "lengths_offset_per_key": lengths_offset_per_key}
        kjt_ops.check_given_caches(self, {**given, "index_per_key": index_per_key})
        del jt_dict  # a cache TorchRec's scripted code passes; recomputed on demand here

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
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> None:
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._length_per_key = length_per_key
        self._offset_per_key = offset_per_key
        self._stride_per_key_per_rank = stride_per_key_per_rank
        self._inverse_indices = inverse_indices
        self._index_per_key: dict[str, int] | None = None
        self._stride_per_key: list[int] | None = None

    @classmethod
    def _trusted(
        cls,
        keys: list[str],
        values: Tensor,
        weights: Tensor | None,
        lengths: Tensor,
        stride: int,
        length_per_key: list[int] | None = None,
        *,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """Build from parts this library produced and already knows to be consistent."""
        kjt = cls.__new__(cls)
        kjt._init(
            keys, values, weights, lengths, None, stride, length_per_key, None, stride_per_key_per_rank, inverse_indices
        )
        return kjt

    # --- alternative constructors ---------------------------------------------------
    @staticmethod
    def from_lengths_sync(
        keys: List[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None,
    ) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            lengths=lengths,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        ).sync()

    @staticmethod
    def from_offsets_sync(
        keys: List[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None,
    ) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            keys,
            values,
            weights,
            offsets=offsets,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        ).sync()

    @staticmethod
    def from_jt_dict(jt_dict: Dict[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """Stack per-key JaggedTensors; differing batch sizes give a variable-batch KJT."""
        return kjt_ops.from_jt_dict(jt_dict)

    @staticmethod
    def concat(kjt_list: List["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of every KJT, in order, over one shared batch (or all variable-batch)."""
        return kjt_ops.concat(kjt_list)

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        values_dtype: Optional[torch.dtype] = None,
        weights_dtype: Optional[torch.dtype] = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """No keys, no values (TorchRec's dtypes: int64 values, float weights, int32 lengths)."""
        values_dtype = torch.int64 if values_dtype is None else values_dtype
        weights_dtype = torch.float32 if weights_dtype is None else weights_dtype
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return KeyedJaggedTensor(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            weights,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
        )

    @staticmethod
    def empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """No keys, on ``kjt``'s device with its dtypes and batch size (its per-key strides if VBE)."""
        return kjt_ops.empty_like(kjt)

    # --- accessors ----------------------------------------------------------------
    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise JaggedAssertionError(f"KeyedJaggedTensor(keys={self._keys}) has no weights; use weights_or_none()")
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

    def size_in_bytes(self) -> int:
        """Bytes of the tensors it holds: values, weights, lengths and offsets (those present), as TorchRec."""
        return ops.tensor_bytes(self._values, self._weights, self._lengths, self._offsets)

    def stride(self) -> int:
        """Batch size: bags per key (with VBE: the batch the outputs expand to)."""
        return self._stride

    def stride_per_key(self) -> List[int]:
        """Bags of each key: ``[stride] * K``, or the per-rank sums with VBE."""
        if self._stride_per_key is None:
            spkpr = self._stride_per_key_per_rank
            self._stride_per_key = (
                [self._stride] * len(self._keys)
                if spkpr is None
                else stride_per_key_of(self._keys, spkpr, f"KeyedJaggedTensor(keys={self._keys})")
            )
        return self._stride_per_key

    def stride_per_key_per_rank(self) -> List[List[int]]:
        """``[K][R]`` bags per key per rank of a VBE KJT; ``[]`` for a fixed batch."""
        spkpr = self._stride_per_key_per_rank
        return [] if spkpr is None else [list(row) for row in spkpr]

    def variable_stride_per_key(self) -> bool:
        """Whether the batch varies per key (``stride_per_key_per_rank`` was given)."""
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> Tuple[List[str], torch.Tensor]:
        if self._inverse_indices is None:
            raise JaggedAssertionError(
                f"KeyedJaggedTensor(keys={self._keys}) has no inverse_indices; use inverse_indices_or_none()"
            )
        return self._inverse_indices

    def inverse_indices_or_none(self) -> Optional[Tuple[List[str], torch.Tensor]]:
        return self._inverse_indices

    def lengths_offset_per_key(self) -> List[int]:
        """Start of each key's lengths in ``lengths()``, plus the total: ``[K + 1]``."""
        out = [0]
        for n in self.stride_per_key():
            out.append(out[-1] + n)
        return out

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> List[int]:
        """Number of ids of each key (one host sync, cached)."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            elif self._values.device.type == "meta":  # no data: split the values evenly, as TorchRec
                total, k = self._values.shape[0], len(self._keys)
                self._length_per_key = [total // k + (total % k if i == 0 else 0) for i in range(k)]
            elif self._stride_per_key_per_rank is not None:
                self._length_per_key = segment_sums(self.lengths(), self.stride_per_key())
            else:
                self._length_per_key = self.lengths().view(len(self._keys), self._stride).sum(1).tolist()
        return self._length_per_key

    def length_per_key_or_none(self) -> Optional[List[int]]:
        return self._length_per_key

    def offset_per_key(self) -> List[int]:
        """Start of each key's ids in ``values()``, plus the total: ``[K + 1]``."""
        if self._offset_per_key is None:
            out = [0]
            for n in self.length_per_key():
                out.append(out[-1] + n)
            self._offset_per_key = out
        return self._offset_per_key

    def offset_per_key_or_none(self) -> Optional[List[int]]:
        return self._offset_per_key

    def index_per_key(self) -> Dict[str, int]:
        """Position of each key (the last one where a permute repeated a key)."""
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def _key_indices(self) -> Dict[str, int]:
        """TorchRec's name for :meth:`index_per_key`."""
        return self.index_per_key()

    def dist_labels(self) -> List[str]:
        """Names of :meth:`dist_tensors` (TorchRec's): lengths, values, then strides (VBE), weights."""
        return kjt_ops.dist_labels(self)

    def dist_splits(self, key_splits: List[int]) -> List[List[int]]:
        """Per destination (keys cut in ``key_splits``): bags, ids, then keys (VBE) and ids (weights)."""
        return kjt_ops.dist_splits(self, key_splits)

    def dist_tensors(self) -> List[torch.Tensor]:
        """The tensors :meth:`dist_labels` names (strides as an int64 tensor on the values' device)."""
        return kjt_ops.dist_tensors(self)

    @staticmethod
    def dist_init(
        keys: List[str],
        tensors: List[torch.Tensor],
        variable_stride_per_key: bool,
        num_workers: int,
        recat: Optional[torch.Tensor],
        stride_per_rank: Optional[List[int]],
        stagger: int = 1,
    ) -> "KeyedJaggedTensor":
        """What an all-to-all of :meth:`dist_tensors` delivered, its sources' segments put key-major by ``recat``."""
        return kjt_ops.dist_init(keys, tensors, variable_stride_per_key, num_workers, recat, stride_per_rank, stagger)

    def _key_index(self, key: str) -> int:
        try:
            return self.index_per_key()[key]
        except KeyError:
            raise KeyError(f"key '{key}' not in KeyedJaggedTensor keys {self._keys}") from None

    def __getitem__(self, key: str) -> JaggedTensor:
        return kjt_ops.getitem(self, self._key_index(key))

    def to_dict(self, compute_offsets: bool = True) -> Dict[str, JaggedTensor]:
        """One JaggedTensor per key."""
        return kjt_ops.to_dict(self, compute_offsets)

    # --- reshaping ----------------------------------------------------------------
    def split(self, segments: List[int]) -> List["KeyedJaggedTensor"]:
        """Consecutive groups of keys: ``segments`` are key counts summing to ``len(keys)``."""
        return kjt_ops.split(self, segments)

    def permute(self, indices: List[int], indices_tensor: Optional[torch.Tensor] = None) -> "KeyedJaggedTensor":
        """New key order: key ``j`` of the result is key ``indices[j]`` (keys may repeat or drop)."""
        return kjt_ops.permute(self, indices, indices_tensor)

    def flatten_lengths(self) -> "KeyedJaggedTensor":
        """The same KJT with 1-D lengths (lengths are always stored 1-D here)."""
        return kjt_ops.flatten_lengths(self)

    # --- movement -----------------------------------------------------------------
    def _map(
        self, fn: Callable[[Tensor], Tensor], weights_fn: Callable[[Tensor], Tensor] | None = None
    ) -> "KeyedJaggedTensor":
        return kjt_ops.map_tensors(self, fn, weights_fn)

    def to(
        self, device: torch.device, non_blocking: bool = False, dtype: Optional[torch.dtype] = None
    ) -> "KeyedJaggedTensor":
        """A copy on ``device``; ``dtype`` (as TorchRec) converts the weights only. ``non_blocking`` defaults to
        False as TorchRec's; ``None`` (what ``RecBatch.to`` passes): asynchronous from host memory to CUDA
        (stream-ordered, so safe; pageable memory is staged in pinned memory first, see :func:`.device_copy.staged`)."""
        return self._map(mover(device, non_blocking), mover(device, non_blocking, dtype))

    def pin_memory(self) -> "KeyedJaggedTensor":
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: torch.cuda.streams.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)  # type: ignore[arg-type]

    def sync(self) -> "KeyedJaggedTensor":
        """Compute and cache ``length_per_key``/``offset_per_key`` now (TorchRec API)."""
        self.offset_per_key()
        return self

    def unsync(self) -> "KeyedJaggedTensor":
        """Drop the cached ``length_per_key``/``offset_per_key`` (TorchRec API)."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    # --- checks -------------------------------------------------------------------
    def validate(self) -> None:
        """Full data checks: negative lengths, offsets vs lengths, totals, named by key."""
        lengths = self._lengths if self._lengths is not None else self.lengths()
        offsets = self._offsets if self._lengths is not None else None
        where = f"KeyedJaggedTensor(keys={self._keys})"
        stride = None if self._stride_per_key_per_rank is not None else self._stride
        _check_data(lengths, offsets, self._values.shape[0], keys=self._keys, stride=stride, where=where)
        _check_weights_count(self._weights, lengths, where=where)

    def __str__(self) -> str:
        """TorchRec's layout: ``KeyedJaggedTensor({"key": [[bag], ...], ...})``."""
        return formatting.keyed_jagged_tensor_str(self)

    def __repr__(self) -> str:
        return formatting.keyed_jagged_tensor_repr(self)
