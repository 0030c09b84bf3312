"""``JaggedTensor``: a batch of variable-length bags, one feature's worth.

Layout (lengths and offsets describe the same thing)::

    bags     [[10, 11], [], [12]]          B = 3 bags
    values   [10, 11, 12]                  [N] ids (or [N, D] embeddings)
    lengths  [2, 0, 1]                     [B]
    offsets  [0, 2, 2, 3]                  [B + 1]
    weights  [1.0, 0.5, 2.0] (optional)    [N], one per value
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.sparse import ops

#: dtypes of lengths and offsets (what fbgemm's jagged operators take; narrower ints overflow)
INDEX_DTYPES = (torch.int32, torch.int64)


def _lengths_from_offsets(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


class JaggedTensor:
    """Variable-length bags: ``JaggedTensor(values, weights=None, lengths=None, offsets=None)``.

    Same argument order and semantics as TorchRec. Give ``lengths`` or ``offsets``
    (or both). Shapes are checked here, and so is the data of CPU tensors (negative
    lengths, offsets that disagree); for device tensors :meth:`validate` checks the data
    (reading it would sync with the device).
    """

    def __init__(
        self,
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError("JaggedTensor needs lengths or offsets (got neither)")
        _check_shapes(values, weights, lengths, offsets, where="JaggedTensor")
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        if values.device.type == "cpu":  # host data: the full check is one cheap pass
            _check_data(self.lengths(), offsets, values.shape[0], keys=None, stride=None, where="JaggedTensor")

    # --- construction -------------------------------------------------------------
    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype = torch.float32,
        lengths_dtype: torch.dtype = torch.int64,
    ) -> JaggedTensor:
        weights = torch.empty(0, device=device) if is_weighted else None
        return JaggedTensor(
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=weights,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def from_dense(values: list[Tensor], weights: list[Tensor] | None = None) -> JaggedTensor:
        """One bag per list entry: ``[tensor([1, 2]), tensor([]), tensor([3])]``."""
        if weights is not None and len(weights) != len(values):
            raise ValueError(f"from_dense got {len(values)} value bags but {len(weights)} weight bags")
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        device = values[0].device if values else None
        cat_values = torch.cat(values) if values else torch.empty(0, device=device)
        cat_weights = torch.cat(weights) if weights is not None and weights else None
        return JaggedTensor(cat_values, cat_weights, lengths=lengths.to(cat_values.device))

    @staticmethod
    def from_dense_lengths(values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> JaggedTensor:
        """Bags from the first ``lengths[b]`` entries of each row of a padded ``[B, L]``."""
        mask = torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1)
        w = weights[mask] if weights is not None else None
        return JaggedTensor(values[mask], w, lengths=lengths)

    # --- accessors ----------------------------------------------------------------
    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights; use weights_or_none()")
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

    # --- conversions --------------------------------------------------------------
    def to_dense(self) -> list[Tensor]:
        """One tensor per bag (the inverse of :meth:`from_dense`)."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_dense_weights(self) -> list[Tensor] | None:
        if self._weights is None:
            return None
        return list(torch.split(self._weights, self.lengths().tolist()))

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> Tensor:
        """``[B, L]`` (or ``[B, L, D]``): bags padded with ``padding_value`` or truncated to L.

        L defaults to the longest bag.
        """
        if desired_length is None:
            lengths = self.lengths()
            desired_length = int(lengths.max()) if lengths.numel() else 0
        return ops.jagged_to_padded_dense(self._values, self.offsets(), desired_length, padding_value)

    def to_padded_dense_weights(self, desired_length: int | None = None, padding_value: float = 0.0) -> Tensor | None:
        if self._weights is None:
            return None
        return JaggedTensor(self._weights, offsets=self.offsets()).to_padded_dense(desired_length, padding_value)

    # --- movement -----------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        out = JaggedTensor.__new__(JaggedTensor)
        out._values = self._values.to(device, non_blocking=non_blocking)
        out._weights, out._lengths, out._offsets = move(self._weights), move(self._lengths), move(self._offsets)
        return out

    def pin_memory(self) -> JaggedTensor:
        out = JaggedTensor.__new__(JaggedTensor)
        out._values = self._values.pin_memory()
        out._weights, out._lengths, out._offsets = (
            None if t is None else t.pin_memory() for t in (self._weights, self._lengths, self._offsets)
        )
        return out

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)  # type: ignore[arg-type]

    # --- checks -------------------------------------------------------------------
    def validate(self) -> None:
        """Full data checks (a pass over lengths/offsets): raises ``ValueError``."""
        _check_data(self.lengths(), self._offsets, self._values.shape[0], keys=None, stride=None, where="JaggedTensor")

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
) -> None:
    """Checks that read at most one number from host tensors and nothing from devices."""
    for name, t in (("values", values), ("weights", weights), ("lengths", lengths), ("offsets", offsets)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if values.dim() == 0:
        raise ValueError(f"{where}: values must have one entry per value, got a 0-d tensor")
    for name, t in (("lengths", lengths), ("offsets", offsets)):
        if t is not None and t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{where}: {name} must be an integer tensor, got dtype {t.dtype} (use int32 or int64)")
    if lengths is not None and lengths.dim() != 1:
        raise ValueError(f"{where}: lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if offsets is not None:
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"{where}: offsets must be 1-D with at least one entry, got shape {tuple(offsets.shape)}")
        if lengths is not None and offsets.numel() != lengths.numel() + 1:
            raise ValueError(
                f"{where}: {offsets.numel()} offsets disagree with {lengths.numel()} lengths "
                f"(offsets need len(lengths) + 1 = {lengths.numel() + 1})"
            )
    if weights is not None and (weights.dim() == 0 or weights.shape[0] != values.shape[0]):
        got = weights.shape[0] if weights.dim() else "a 0-d tensor of"
        raise ValueError(f"{where}: {got} weights for {values.shape[0]} values (need one per value)")
    if values.device.type != "cpu":
        return  # reading lengths would sync with the device; validate() checks them
    if lengths is not None:
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.shape[0]:
            raise ValueError(f"{where}: lengths sum to {total} but there are {values.shape[0]} values")
    elif offsets is not None:
        span = int(offsets[-1]) - int(offsets[0])
        if span != values.shape[0]:
            raise ValueError(f"{where}: offsets span {span} values but there are {values.shape[0]}")


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
    if offsets is not None:
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
    if total != num_values:
        raise ValueError(f"{where}: lengths sum to {total} but there are {num_values} values")
