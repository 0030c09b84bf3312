"""Argument checks of ``KeyedJaggedTensor``'s constructor, variable batch included.

Variable batch per feature ("VBE"): key ``k`` holds ``sum(stride_per_key_per_rank[k])``
bags instead of ``stride`` bags; ranks are the inner list (one entry per rank whose
batch went into the KJT)::

    keys                      ["user", "item"]
    stride_per_key_per_rank   [[1, 1], [2, 3]]   user: 2 bags, item: 5 bags
    lengths                   [1, 2,  1, 0, 3, 1, 1]  (key-major: 2 + 5 entries)
    stride_per_key            [2, 5]
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_shardrec.sparse.errors import JaggedAssertionError
from lightning_shardrec.sparse.jagged_tensor import _check_data, _check_shapes

KJTParts = tuple[list[str], Tensor | None, Tensor | None, int, list[list[int]] | None, tuple[list[str], Tensor] | None]


def is_int(n: object) -> bool:
    """An int (numpy and symbolic ints included), not a bool."""
    return isinstance(n, (numbers.Integral, torch.SymInt)) and not isinstance(n, bool)


def check_keys(keys: object) -> list[str]:
    """``keys`` as a list of str; a bare string or non-str keys are a ``TypeError``."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"KeyedJaggedTensor keys must be a list of feature names, got {keys!r}")
    out = list(keys)
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise TypeError(f"KeyedJaggedTensor keys must be str, got {bad} in {out}")
    return out


def check_kjt_args(
    keys: object,
    values: object,
    weights: Tensor | None,
    lengths: Tensor | None,
    offsets: Tensor | None,
    stride: object,
    stride_per_key_per_rank: object,
    inverse_indices: object,
    length_per_key: list[int] | None,
) -> KJTParts:
    """Check the constructor's arguments; ``(keys, lengths, offsets, stride, spkpr, inverse)``.

    As permissive as TorchRec about what values hold (any dtype, ``[N]`` or ``[N, D]``,
    longer than ``sum(lengths)``): ids are checked where they are looked up. Refused:
    structure that describes bags the values do not have.
    """
    keys = check_keys(keys)
    where = f"KeyedJaggedTensor(keys={keys})"
    if not isinstance(values, Tensor):
        raise TypeError(f"{where}: values must be a torch.Tensor, got {type(values).__name__}")
    if lengths is None and offsets is None:
        if keys:
            raise JaggedAssertionError(f"{where} needs lengths or offsets (got neither)")
        lengths = torch.empty(0, dtype=torch.int32, device=values.device)
    if isinstance(lengths, Tensor) and lengths.dim() == 2:  # TorchRec's [K, B] layout
        lengths = lengths.reshape(-1)
    lengths, offsets = _check_shapes(values, weights, lengths, offsets, where=where)
    if weights is not None and weights.dim() != 1:
        raise ValueError(f"{where}: weights must be a 1-D tensor (one per value), got shape {tuple(weights.shape)}")
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"KeyedJaggedTensor keys must be unique, repeated: {dup}")
    num_bags = lengths.numel() if lengths is not None else max(offsets.numel() - 1, 0)  # type: ignore[union-attr]
    spkpr = check_stride_per_key_per_rank(stride_per_key_per_rank, keys, where)
    inverse = check_inverse_indices(inverse_indices, where)
    stride = infer_stride(keys, num_bags, stride, spkpr, inverse, where)
    if values.device.type == "cpu":  # host data: the full check is one cheap pass
        host_lengths = lengths if lengths is not None else offsets[1:] - offsets[:-1]  # type: ignore[index]
        data_stride = None if spkpr is not None else stride
        _check_data(host_lengths, offsets, values.shape[0], keys=keys, stride=data_stride, where=where)
        if length_per_key is not None and keys:
            actual = (
                segment_sums(host_lengths, stride_per_key_of(keys, spkpr, where))
                if spkpr is not None
                else host_lengths.view(len(keys), stride).sum(1).tolist()
            )
            if list(length_per_key) != actual:
                raise ValueError(f"{where}: length_per_key {list(length_per_key)} but the lengths give {actual}")
    return keys, lengths, offsets, stride, spkpr, inverse


def check_stride_per_key_per_rank(value: object, keys: list[str], where: str) -> list[list[int]] | None:
    """``[K][R]`` ints >= 0 (a list of lists or a 2-D integer tensor) as a list of lists."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dim() not in (1, 2):
            raise ValueError(
                f"{where}: stride_per_key_per_rank must be a 2-D integer tensor [keys, ranks], "
                f"got shape {tuple(value.shape)} dtype {value.dtype}"
            )
        value = value.reshape(value.shape[0], -1).tolist() if value.dim() == 2 else [[n] for n in value.tolist()]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{where}: stride_per_key_per_rank must be a list of lists of ints, got {value!r}")
    rows = []
    for row in value:
        if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
            raise TypeError(f"{where}: stride_per_key_per_rank must be a list of lists of ints, got row {row!r}")
        row = list(row)
        if any(not is_int(n) or n < 0 for n in row):
            raise ValueError(f"{where}: stride_per_key_per_rank entries must be ints >= 0, got row {row}")
        rows.append([int(n) for n in row])
    return rows


def check_inverse_indices(value: object, where: str) -> tuple[list[str], Tensor] | None:
    """``(keys, tensor [len(keys), batch])`` as TorchRec takes it."""
    if value is None:
        return None
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], Tensor)):
        raise TypeError(f"{where}: inverse_indices must be a (keys, tensor) pair, got {type(value).__name__}")
    keys = check_keys(value[0])
    tensor: Tensor = value[1]
    if tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(f"{where}: inverse_indices tensor must hold integer rows, got dtype {tensor.dtype}")
    return keys, tensor


def infer_stride(
    keys: list[str],
    num_bags: int,
    stride: object,
    spkpr: list[list[int]] | None,
    inverse_indices: tuple[list[str], Tensor] | None,
    where: str,
) -> int:
    """The batch size: given, or from the lengths (fixed batch) or the per-key strides (VBE)."""
    if stride is not None and (not is_int(stride) or stride < 0):  # type: ignore[operator]
        raise ValueError(f"{where}: stride (batch size) must be an int >= 0, got {stride!r}")
    if spkpr is not None:
        total = sum(sum(row) for row in spkpr)
        if total != num_bags:
            raise ValueError(
                f"{where}: stride_per_key_per_rank {spkpr} describes {total} bags but there are {num_bags} lengths"
            )
        if stride is not None:
            return int(stride)  # type: ignore[call-overload]
        if not keys:
            return 0
        if any(spkpr_row for spkpr_row in spkpr):
            if inverse_indices is not None and inverse_indices[1].numel() > 0:
                return int(inverse_indices[1].shape[-1])
            return max(sum(row) for row in spkpr)
        return num_bags // len(keys)
    if stride is None:
        if not keys:
            if num_bags:
                raise ValueError(f"KeyedJaggedTensor has no keys but {num_bags} lengths")
            return 0
        if num_bags % len(keys):
            raise ValueError(
                f"{num_bags} lengths do not divide into {len(keys)} keys {keys} "
                "(lengths are key-major: len(keys) * batch_size entries)"
            )
        return num_bags // len(keys)
    if stride * len(keys) != num_bags:  # type: ignore[operator]
        raise ValueError(
            f"stride {stride} x {len(keys)} keys {keys} needs {stride * len(keys)} lengths, got {num_bags}"  # type: ignore[operator]
        )
    return int(stride)  # type: ignore[call-overload]


def stride_per_key_of(keys: list[str], spkpr: list[list[int]], where: str) -> list[int]:
    """Bags per key of a VBE KJT (one row of ``stride_per_key_per_rank`` per key)."""
    if len(spkpr) != len(keys):
        raise JaggedAssertionError(
            f"{where}: stride_per_key_per_rank has {len(spkpr)} rows for {len(keys)} keys (needs one row per key)"
        )
    return [sum(row) for row in spkpr]


def check_per_key(
    keys: list[str], num_values: int, length_per_key: list[int] | None, offset_per_key: list[int] | None, where: str
) -> None:
    """Caller-given per-key totals must match the keys and fit in the values."""
    if length_per_key is not None:
        lpk = list(length_per_key)
        if len(lpk) != len(keys) or any(n < 0 for n in lpk) or sum(lpk) > num_values:
            raise ValueError(
                f"{where}: length_per_key {lpk} needs one count >= 0 per key ({len(keys)}) "
                f"summing to at most the {num_values} ids"
            )
    if offset_per_key is not None:
        opk = list(offset_per_key)
        ok = len(opk) == len(keys) + 1 and opk[0] == 0 and opk[-1] <= num_values
        if not ok or any(b < a for a, b in zip(opk, opk[1:], strict=False)):
            raise ValueError(
                f"{where}: offset_per_key {opk} needs {len(keys) + 1} non-decreasing entries from 0 "
                f"to at most {num_values}"
            )
        if length_per_key is not None and [b - a for a, b in zip(opk, opk[1:], strict=False)] != list(length_per_key):
            raise ValueError(f"{where}: offset_per_key {opk} disagrees with length_per_key {list(length_per_key)}")


def segment_sums(lengths: Tensor, segments: Sequence[int]) -> list[int]:
    """Sum of each consecutive run of ``segments[i]`` lengths (one host sync)."""
    if not segments:
        return []
    bounds = torch.tensor([0, *segments], device=lengths.device).cumsum(0)
    csum = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.long(), 0, out=csum[1:])
    return (csum[bounds[1:]] - csum[bounds[:-1]]).tolist()
