"""``JaggedTensor``: a batch of variable-length bags, one feature's worth.

Layout (lengths and offsets describe the same thing)::

    bags     [[10, 11], [], [12]]          B = 3 bags
    values   [10, 11, 12]                  [N] ids (or [N, D] embeddings)
    lengths  [2, 0, 1]                     [B]
    offsets  [0, 2, 2, 3]                  [B + 1]
    weights  [1.0, 0.5, 2.0] (optional)    [N], one per value

As in TorchRec, values (and weights) may run longer than ``sum(lengths)``: the tail
belongs to no bag and is ignored. Values may be of any dtype, ``[N]`` or ``[N, D]``.
"""

from typing import List, Optional, cast

import torch
from torch import Tensor

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.sparse import formatting, ops
from lightning_shardrec.sparse.errors import JaggedAssertionError
from lightning_shardrec.sparse.fx_proxy import ProxyableConstruction, _tracer_of

#: dtypes of lengths and offsets (what fbgemm's jagged operators take; narrower ints overflow)
INDEX_DTYPES = (torch.int32, torch.int64)


def _optional_mask(t: Tensor | None, mask: Tensor) -> Tensor | None:
    """``t[mask]``, or None without ``t``: one fx node, so a traced ``from_dense_lengths`` takes either."""
    return None if t is None else t[mask]


torch.fx.wrap("_optional_mask")


def int_item(t: Tensor) -> int:
    """``t.item()`` of a one-element integer tensor: an int, or a size torch.export keeps symbolic (``int(t)``
    would guard on the data)."""
    return cast(int, t.item())


def _lengths_from_offsets(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


class JaggedTensor(metaclass=ProxyableConstruction):
    """Variable-length bags: ``JaggedTensor(values, weights=None, lengths=None, offsets=None)``.

    Same argument order and semantics as TorchRec. Give ``lengths`` or ``offsets``
    (or both). Shapes are checked here, and so is the data of CPU tensors (negative
    lengths, offsets that disagree); for device tensors :meth:`validate` checks the data
    (reading it would sync with the device).
    """

    def __init__(
        self,
        values: Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise JaggedAssertionError("JaggedTensor needs lengths or offsets (got neither)")
        lengths, offsets = _check_shapes(values, weights, lengths, offsets, where="JaggedTensor")
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        if values.device.type == "cpu" and not torch.compiler.is_compiling():  # host data: one cheap pass
            _check_data(self.lengths(), offsets, values.shape[0], keys=None, stride=None, where="JaggedTensor")

    # --- construction -------------------------------------------------------------
    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        values_dtype: Optional[torch.dtype] = None,
        weights_dtype: Optional[torch.dtype] = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "JaggedTensor":
        """No bags: empty values, lengths and offsets (TorchRec's int32 lengths by default)."""
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        out = JaggedTensor.__new__(JaggedTensor)
        out._values = torch.empty(0, dtype=values_dtype, device=device)
        out._weights = weights
        out._lengths = torch.empty(0, dtype=lengths_dtype, device=device)
        out._offsets = torch.empty(0, dtype=lengths_dtype, device=device)
        return out

    @staticmethod
    def empty_like(jt: "JaggedTensor") -> "JaggedTensor":
        """No bags, on ``jt``'s device with its dtypes (weighted if ``jt`` is)."""
        weights = jt.weights_or_none()
        return JaggedTensor.empty(
            is_weighted=weights is not None,
            device=jt.device(),
            values_dtype=jt.values().dtype,
            weights_dtype=None if weights is None else weights.dtype,
            lengths_dtype=jt.lengths().dtype,
        )

    @staticmethod
    def from_dense(values: List[torch.Tensor], weights: Optional[List[torch.Tensor]] = None) -> "JaggedTensor":
        """One bag per list entry: ``[tensor([1, 2]), tensor([]), tensor([3])]``."""
        if (tracer := _tracer_of((values, weights), {})) is not None:  # fx: one node
            return tracer.create_proxy("call_function", JaggedTensor.from_dense, (values, weights), {})  # type: ignore[no-any-return]
        if weights is not None and len(weights) != len(values):
            raise ValueError(f"from_dense got {len(values)} value bags but {len(weights)} weight bags")
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int32)
        device = values[0].device if values else None
        cat_values = torch.cat(values) if values else torch.empty(0, device=device)
        cat_weights = torch.cat(weights) if weights is not None and weights else None
        return JaggedTensor(cat_values, cat_weights, lengths=lengths.to(cat_values.device))

    @staticmethod
    def from_dense_lengths(values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> "JaggedTensor":
        """Bags from the first ``lengths[b]`` entries of each row of a padded ``[B, L]``."""
        mask = torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1)
        return JaggedTensor(values[mask], _optional_mask(weights, mask), lengths=lengths)

    # --- accessors ----------------------------------------------------------------
    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise JaggedAssertionError("this JaggedTensor has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def lengths(self) -> Tensor:
        if self._lengths is None:
            self._lengths = _lengths_from_offsets(self._offsets)  # type: ignore[arg-type]
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        return self._lengths

    def offsets(self) -> Tensor:
        if self._offsets is None:
            self._offsets = ops.complete_cumsum(self._lengths)  # type: ignore[arg-type]
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes of the tensors it holds: values, weights, lengths and offsets (those present), as TorchRec."""
        return ops.tensor_bytes(self._values, self._weights, self._lengths, self._offsets)

    # --- conversions --------------------------------------------------------------
    def to_dense(self) -> List[Tensor]:
        """One tensor per bag (the inverse of :meth:`from_dense`)."""
        sizes = self.lengths().tolist()
        return list(torch.split(self._values[: sum(sizes)], sizes))

    def to_dense_weights(self) -> Optional[List[Tensor]]:
        if self._weights is None:
            return None
        sizes = self.lengths().tolist()
        return list(torch.split(self._weights[: sum(sizes)], sizes))

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> Tensor:
        """``[B, L]`` (or ``[B, L, D]``): bags padded with ``padding_value`` or truncated to L.

        L defaults to the longest bag.
        """
        length = desired_length
        if length is None:
            lengths = self.lengths()
            length = int_item(lengths.max()) if lengths.numel() else 0
        offsets = self.offsets()
        if offsets.numel() == 0:  # TorchRec's empty(): no bags
            offsets = torch.zeros(1, dtype=offsets.dtype, device=offsets.device)
        values = self._values
        if values.device.type != "meta":
            total = int_item(offsets[-1])
            compat.check(total <= values.shape[0])
            values = values[:total]
        return ops.jagged_to_padded_dense(values, offsets, length, padding_value)

    def to_padded_dense_weights(self, desired_length: int | None = None, padding_value: float = 0.0) -> Tensor | None:
        if self._weights is None:
            return None
        return JaggedTensor(self._weights, offsets=self.offsets(), lengths=self.lengths()).to_padded_dense(
            desired_length, padding_value
        )

    # --- movement -----------------------------------------------------------------
    def to(self, device: torch.device, non_blocking: bool = False) -> "JaggedTensor":
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        out = JaggedTensor.__new__(JaggedTensor)
        out._values = self._values.to(device, non_blocking=non_blocking)
        out._weights, out._lengths, out._offsets = move(self._weights), move(self._lengths), move(self._offsets)
        return out

    def pin_memory(self) -> "JaggedTensor":
        out = JaggedTensor.__new__(JaggedTensor)
        out._values = self._values.pin_memory()
        out._weights, out._lengths, out._offsets = (
            None if t is None else t.pin_memory() for t in (self._weights, self._lengths, self._offsets)
        )
        return out

    def record_stream(self, stream: torch.cuda.streams.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)  # type: ignore[arg-type]

    # --- checks -------------------------------------------------------------------
    def validate(self) -> None:
        """Full data checks (a pass over lengths/offsets): raises ``ValueError``."""
        _check_data(self.lengths(), self._offsets, self._values.shape[0], keys=None, stride=None, where="JaggedTensor")
        _check_weights_count(self._weights, self.lengths(), where="JaggedTensor")

    def __str__(self) -> str:
        """TorchRec's layout: ``JaggedTensor({[[bag], ...]})``."""
        return formatting.jagged_tensor_str(self)

    def __repr__(self) -> str:
        parts = [f"values={self._values}"]
        if self._weights is not None:
            parts.append(f"weights={self._weights}")
        parts.append(f"lengths={self.lengths()}")
        return "JaggedTensor(" + ", ".join(parts) + ")"


def _check_shapes(
    values: Tensor,
    weights: Tensor | None,
    lengths: Tensor | None,
    offsets: Tensor | None,
    *,
    where: str,
) -> tuple[Tensor | None, Tensor | None]:
    """Checks that read at most one number from host tensors and nothing from devices.

    Returns ``(lengths, offsets)``; empty ones of a non-integer dtype (TorchRec accepts
    ``torch.tensor([])``) come back as int32.
    """
    for name, t in (("values", values), ("weights", weights), ("lengths", lengths), ("offsets", offsets)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if values.dim() == 0:
        raise ValueError(f"{where}: values must have one entry per value, got a 0-d tensor")
    lengths, offsets = _index_dtype(lengths, "lengths", where), _index_dtype(offsets, "offsets", where)
    if lengths is not None and lengths.dim() != 1:
        raise ValueError(f"{where}: lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if offsets is not None:
        no_bags = offsets.numel() == 0 and (lengths is None or lengths.numel() == 0)
        if offsets.dim() != 1 or (offsets.numel() < 1 and not no_bags):
            raise ValueError(f"{where}: offsets must be 1-D with at least one entry, got shape {tuple(offsets.shape)}")
        if not no_bags and lengths is not None and offsets.numel() != lengths.numel() + 1:
            raise ValueError(
                f"{where}: {offsets.numel()} offsets disagree with {lengths.numel()} lengths "
                f"(offsets need len(lengths) + 1 = {lengths.numel() + 1})"
            )
    if weights is not None and weights.dim() == 0:
        raise ValueError(f"{where}: weights must have one entry per value, got a 0-d tensor")
    if values.device.type != "cpu" or torch.compiler.is_compiling():
        # reading lengths would sync with the device (validate() checks them) or, under torch.export /
        # torch.compile, branch on data the traced program does not have
        return lengths, offsets
    if lengths is not None:
        total = int(lengths.sum()) if lengths.numel() else 0
        if total > values.shape[0]:
            raise ValueError(f"{where}: lengths sum to {total} but there are {values.shape[0]} values")
    elif offsets is not None and offsets.numel():
        total = int(offsets[-1]) - int(offsets[0])
        if total > values.shape[0]:
            raise ValueError(f"{where}: offsets span {total} values but there are {values.shape[0]}")
    else:
        total = 0
    if weights is not None and weights.shape[0] < total:
        raise ValueError(f"{where}: {weights.shape[0]} weights for {total} values (need one per value)")
    return lengths, offsets


def _index_dtype(t: Tensor | None, name: str, where: str) -> Tensor | None:
    """Lengths/offsets must be int32/int64; empty ones of another dtype become int32."""
    if t is None or t.dtype in INDEX_DTYPES:
        return t
    if t.numel() == 0:
        return t.to(torch.int32)
    raise JaggedAssertionError(f"{where}: {name} must be an integer tensor, got dtype {t.dtype} (use int32 or int64)")


def _check_weights_count(weights: Tensor | None, lengths: Tensor, *, where: str) -> None:
    if weights is None:
        return
    total = int(lengths.sum()) if lengths.numel() else 0
    if weights.shape[0] < total:
        raise ValueError(f"{where}: {weights.shape[0]} weights for {total} values (need one per value)")


def _check_data(
    lengths: Tensor,
    offsets: Tensor | None,
    num_values: int,
    *,
    keys: list[str] | None,
    stride: int | None,
    where: str,
) -> None:
    """Negative lengths, offsets that disagree with lengths, totals: names the key."""

    def locate(i: int) -> str:
        if keys is None or not stride:
            return f"bag {i}"
        return f"key '{keys[i // stride]}' (bag {i % stride} of {stride})"

    lengths = lengths.cpu()
    if lengths.numel() and int(lengths.min()) < 0:
        i = int((lengths < 0).nonzero()[0])
        raise ValueError(f"{where}: negative length {int(lengths[i])} at {locate(i)}; lengths must be >= 0")
    if offsets is not None and offsets.numel():
        offsets = offsets.cpu()
        if int(offsets[0]) != 0:
            raise ValueError(f"{where}: offsets must start at 0, got {int(offsets[0])}")
        diff = (offsets[1:] - offsets[:-1]) != lengths
        if diff.any():
            i = int(diff.nonzero()[0])
            raise ValueError(
                f"{where}: offsets disagree with lengths at {locate(i)}: offsets give "
                f"{int(offsets[i + 1] - offsets[i])}, lengths give {int(lengths[i])}"
            )
    total = int(lengths.sum())
    if total > num_values:
        raise ValueError(f"{where}: lengths sum to {total} but there are {num_values} values")


_EQUALITY_NAMES = frozenset(
    ("jt_is_equal", "kjt_is_equal", "regroup_kts", "_all_keys_used_once", "_regroup_keyed_tensors",
     "permute_multi_embedding", "_fbgemm_permute_pooled_embs", "_kt_regroup_arguments")
)  # fmt: skip


def __getattr__(name: str) -> object:
    """TorchRec's ``torchrec.sparse.jagged_tensor`` also holds the keyed types (imported late: they import this)."""
    if name == "KeyedJaggedTensor":
        from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor
    if name == "KeyedTensor":
        from lightning_shardrec.sparse.keyed_tensor import KeyedTensor

        return KeyedTensor
    if name in ("ComputeJTDictToKJT", "ComputeKJTToJTDict"):
        from lightning_shardrec.sparse import convert_modules

        return getattr(convert_modules, name)
    if name in _EQUALITY_NAMES:
        from lightning_shardrec.sparse import equality

        return getattr(equality, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
