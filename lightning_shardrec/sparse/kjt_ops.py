"""Reshaping a ``KeyedJaggedTensor``: split, permute, concat, from_jt_dict, to_dict.

Each works for a fixed batch (``lengths`` is ``[K * B]``) and for a variable batch per
key (VBE: key ``k`` has ``stride_per_key()[k]`` bags), exactly as TorchRec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_shardrec.sparse import ops
from lightning_shardrec.sparse.errors import JaggedAssertionError, JaggedIndexError
from lightning_shardrec.sparse.fx_proxy import _tracer_of
from lightning_shardrec.sparse.jagged_tensor import JaggedTensor

if TYPE_CHECKING:
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor


def split(kjt: KeyedJaggedTensor, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
    """Consecutive groups of keys: ``segments`` are key counts summing to ``len(keys)``."""
    keys = kjt.keys()
    if sum(segments) != len(keys) or any(s < 0 for s in segments):
        raise JaggedIndexError(f"split segments {list(segments)} must be non-negative and sum to {len(keys)} keys")
    opk, lpk, lopk = kjt.offset_per_key(), kjt.length_per_key(), kjt.lengths_offset_per_key()
    spkpr = kjt._stride_per_key_per_rank
    weights, values, lengths = kjt.weights_or_none(), kjt.values(), kjt.lengths()
    out, k = [], 0
    for seg in segments:
        if seg == len(keys):
            out.append(kjt)
        else:
            start, end = opk[k], opk[k + seg]
            out.append(
                type(kjt)._trusted(
                    keys[k : k + seg],
                    values[start:end],
                    None if weights is None else weights[start:end],
                    lengths[lopk[k] : lopk[k + seg]],
                    kjt.stride(),
                    lpk[k : k + seg],
                    stride_per_key_per_rank=None if spkpr is None else spkpr[k : k + seg],
                )
            )
        k += seg
    return out


def permute(kjt: KeyedJaggedTensor, indices: Sequence[int], indices_tensor: Tensor | None = None) -> KeyedJaggedTensor:
    """New key order: key ``j`` of the result is key ``indices[j]`` (keys may repeat or drop)."""
    keys = kjt.keys()
    bad = [i for i in indices if not 0 <= i < len(keys)]
    if bad:
        raise JaggedIndexError(f"permute indices {bad} outside [0, {len(keys)}) for keys {keys}")
    new_keys = [keys[i] for i in indices]
    lpk = kjt.length_per_key()
    new_lpk = [lpk[i] for i in indices]
    spkpr = kjt._stride_per_key_per_rank
    if spkpr is not None:
        spk, lopk, opk = kjt.stride_per_key(), kjt.lengths_offset_per_key(), kjt.offset_per_key()
        device = kjt.device()
        length_index = _segments_index([lopk[i] for i in indices], [spk[i] for i in indices], device)
        value_index = _segments_index([opk[i] for i in indices], new_lpk, device)
        weights = kjt.weights_or_none()
        return type(kjt)._trusted(
            new_keys,
            kjt.values().index_select(0, value_index),
            None if weights is None else weights.index_select(0, value_index),
            kjt.lengths().index_select(0, length_index),
            kjt.stride(),
            new_lpk,
            stride_per_key_per_rank=[spkpr[i] for i in indices],
        )
    if indices_tensor is None:
        indices_tensor = _index_tensor(tuple(indices), kjt.device())
    total = kjt.offset_per_key()[-1]
    values, weights = kjt.values(), kjt.weights_or_none()
    if values.shape[0] != total:  # a tail past the last bag is not part of any key
        values = values[:total]
        weights = None if weights is None else weights[:total]
    lengths, values, weights = ops.permute_2d(
        indices_tensor,
        kjt.lengths().view(len(keys), kjt.stride()),
        values,
        weights,
        permuted_values_numel=sum(new_lpk),
    )
    return type(kjt)._trusted(new_keys, values, weights, lengths.reshape(-1), kjt.stride(), new_lpk)


@functools.lru_cache(maxsize=256)
def _index_tensor(indices: tuple[int, ...], device: torch.device) -> Tensor:
    """``indices`` on ``device``, made once: a permutation is fixed per collection, and each
    ``torch.tensor(list, device="cuda")`` is a blocking copy (it waits for the stream)."""
    with torch.inference_mode(False):  # made under inference mode, it could not join autograd later
        return torch.tensor(indices, dtype=torch.long, device=device)


def _segments_index(starts: list[int], sizes: list[int], device: torch.device) -> Tensor:
    """Positions of the concatenated ranges ``[starts[i], starts[i] + sizes[i])``."""
    return ops.gather_index(
        torch.tensor(starts, dtype=torch.long, device=device),
        torch.tensor(sizes, dtype=torch.long, device=device),
        total=sum(sizes),
    )


def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Keys of every KJT, in order, over one shared batch (or all VBE)."""
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor

    if (tracer := _tracer_of((kjt_list,), {})) is not None:  # fx: one node, as TorchRec's
        return tracer.create_proxy("call_function", concat, (kjt_list,), {})  # type: ignore[no-any-return]
    if not kjt_list:
        raise ValueError("KeyedJaggedTensor.concat needs at least one KJT")
    vbe = {kjt.variable_stride_per_key() for kjt in kjt_list}
    if len(vbe) > 1:
        raise JaggedAssertionError(
            "KeyedJaggedTensor.concat cannot mix variable-batch (stride_per_key_per_rank) and fixed-batch KJTs"
        )
    variable = vbe.pop()
    strides = {kjt.stride() for kjt in kjt_list if kjt.keys()}
    if not variable and len(strides) > 1:
        raise JaggedAssertionError(f"KeyedJaggedTensor.concat needs one batch size, got strides {sorted(strides)}")
    weighted = {kjt.weights_or_none() is not None for kjt in kjt_list if kjt.keys()}
    if len(weighted) > 1:
        raise ValueError("KeyedJaggedTensor.concat cannot mix weighted and unweighted KJTs")
    inverse = [kjt.inverse_indices_or_none() for kjt in kjt_list]
    if any(i is not None for i in inverse) and any(i is None for i in inverse):
        raise JaggedAssertionError("KeyedJaggedTensor.concat: inverse_indices must be set on all KJTs or on none")
    keys = [k for kjt in kjt_list for k in kjt.keys()]  # noqa: SIM118 (a KJT, not a dict)
    totals = [kjt.offset_per_key()[-1] if kjt.keys() else 0 for kjt in kjt_list]
    # KJTs without keys hold no values, so they add no weights (and may have none).
    weights = None
    if weighted == {True}:
        weights = torch.cat([kjt.weights()[:n] for kjt, n in zip(kjt_list, totals, strict=True) if kjt.keys()])
    out = KeyedJaggedTensor._trusted(
        keys,
        torch.cat([kjt.values()[:n] for kjt, n in zip(kjt_list, totals, strict=True)]),
        weights,
        torch.cat([kjt.lengths().reshape(-1) for kjt in kjt_list]),
        _concat_stride(kjt_list, strides, variable, inverse),
        [n for kjt in kjt_list for n in kjt.length_per_key()],
        stride_per_key_per_rank=(
            [row for kjt in kjt_list for row in kjt.stride_per_key_per_rank()] if variable else None
        ),
        inverse_indices=(
            ([k for i in inverse for k in i[0]], torch.cat([i[1] for i in inverse]))  # type: ignore[index]
            if inverse and inverse[0] is not None
            else None
        ),
    )
    if all(kjt._length_per_key is None for kjt in kjt_list):
        out._length_per_key = None  # as TorchRec: concat of unsynced KJTs stays unsynced
    return out


def _concat_stride(
    kjt_list: Sequence[KeyedJaggedTensor],
    strides: set[int],
    variable: bool,
    inverse: list[tuple[list[str], Tensor] | None],
) -> int:
    if not variable:
        return strides.pop() if strides else kjt_list[0].stride()
    if inverse and inverse[0] is not None:
        return int(inverse[0][1].shape[-1])
    return max([sum(row) for kjt in kjt_list for row in kjt.stride_per_key_per_rank()], default=0)


def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
    """Stack per-key JaggedTensors; different batch sizes give a VBE KJT (one rank)."""
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor

    if (tracer := _tracer_of((jt_dict,), {})) is not None:  # fx: one node
        return tracer.create_proxy("call_function", from_jt_dict, (jt_dict,), {})  # type: ignore[no-any-return]
    if not jt_dict:
        return KeyedJaggedTensor.empty()
    jts = list(jt_dict.values())
    weighted = [jt.weights_or_none() is not None for jt in jts]
    if any(weighted) and not all(weighted):
        missing = [k for k, w in zip(jt_dict, weighted, strict=True) if not w]
        raise ValueError(f"from_jt_dict: keys {missing} have no weights while others do")
    batch = [jt.lengths().numel() for jt in jts]
    totals = [_jt_total(jt) for jt in jts]
    weights = torch.cat([jt.weights()[:n] for jt, n in zip(jts, totals, strict=True)]) if all(weighted) else None
    same = len(set(batch)) == 1
    return KeyedJaggedTensor(
        list(jt_dict),
        torch.cat([jt.values()[:n] for jt, n in zip(jts, totals, strict=True)]),
        weights,
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=batch[0] if same else None,
        stride_per_key_per_rank=None if same else [[b] for b in batch],
    ).sync()


def _jt_total(jt: JaggedTensor) -> int:
    """Values the bags of ``jt`` cover (its values may run longer)."""
    if jt.values().device.type == "meta":
        return jt.values().shape[0]
    lengths = jt.lengths()
    return int(lengths.sum()) if lengths.numel() else 0


def to_dict(kjt: KeyedJaggedTensor, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
    """One JaggedTensor per key (offsets computed too unless ``compute_offsets=False``)."""
    out = {}
    no_bags = kjt.lengths().numel() == 0
    for key in kjt.keys():  # noqa: SIM118 (a KJT, not a dict)
        jt = kjt[key]
        if no_bags:  # as TorchRec: a batch of no bags has empty offsets too
            jt._offsets = jt.lengths()
        elif compute_offsets:
            jt.offsets()
        out[key] = jt
    return out


def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """No keys, on ``kjt``'s device with its dtypes and batch size (its per-key strides if VBE)."""
    if (tracer := _tracer_of((kjt,), {})) is not None:  # fx: one node, as TorchRec's
        return tracer.create_proxy("call_function", empty_like, (kjt,), {})  # type: ignore[no-any-return]
    weights, device = kjt.weights_or_none(), kjt.device()
    return type(kjt)._trusted(
        [],
        torch.empty(0, dtype=kjt.values().dtype, device=device),
        None if weights is None else torch.empty(0, dtype=weights.dtype, device=device),
        torch.empty(0, dtype=kjt.lengths().dtype, device=device),
        kjt.stride(),
        None,
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None,
    )


def check_given_caches(kjt: KeyedJaggedTensor, given: dict[str, object]) -> None:
    """Caches TorchRec's scripted code passes to the constructor must agree with the KJT."""
    actual: dict[str, object] = {
        "stride_per_key": kjt.stride_per_key,
        "lengths_offset_per_key": kjt.lengths_offset_per_key,
        "index_per_key": kjt.index_per_key,
    }
    for name, value in given.items():
        if value is None:
            continue
        want = actual[name]()  # type: ignore[operator]
        got = dict(value) if isinstance(value, dict) else list(value)  # type: ignore[call-overload]
        if got != want:
            raise ValueError(f"KeyedJaggedTensor(keys={kjt.keys()}): {name} {got} but the batch gives {want}")


def getitem(kjt: KeyedJaggedTensor, i: int) -> JaggedTensor:
    """Key ``i``'s bags as a JaggedTensor (views of the KJT's tensors)."""
    start, end = kjt.offset_per_key()[i], kjt.offset_per_key()[i + 1]
    lopk = kjt.lengths_offset_per_key()
    lengths = kjt.lengths()[lopk[i] : lopk[i + 1]]
    weights = None if kjt._weights is None else kjt._weights[start:end]
    out = JaggedTensor.__new__(JaggedTensor)
    out._values, out._weights, out._lengths, out._offsets = kjt._values[start:end], weights, lengths, None
    return out


def dist_labels(kjt: KeyedJaggedTensor) -> list[str]:
    """Names of ``dist_tensors`` (TorchRec's): lengths, values, then strides (VBE), weights."""
    labels = ["lengths", "values"]
    if kjt.variable_stride_per_key():
        labels.append("strides")
    if kjt.weights_or_none() is not None:
        labels.append("weights")
    return labels


def dist_splits(kjt: KeyedJaggedTensor, key_splits: list[int]) -> list[list[int]]:
    """Per destination (keys cut in ``key_splits``): bags, ids, then keys (VBE) and ids (weights)."""
    if sum(key_splits) != len(kjt._keys):
        total = sum(key_splits)
        raise ValueError(f"dist_splits: key_splits {key_splits} sum to {total}, not {len(kjt._keys)} keys")

    def by_splits(values: list[int]) -> list[int]:
        out, i = [], 0
        for n in key_splits:
            out.append(sum(values[i : i + n]))
            i += n
        return out

    length_per_split = by_splits(kjt.length_per_key())
    splits = [by_splits(kjt.stride_per_key()), length_per_split]
    if kjt.variable_stride_per_key():
        splits.append(list(key_splits))
    if kjt.weights_or_none() is not None:
        splits.append(length_per_split)
    return splits


def dist_tensors(kjt: KeyedJaggedTensor) -> list[Tensor]:
    """The tensors ``dist_labels`` names (strides as an int64 tensor on the values' device)."""
    tensors = [kjt.lengths(), kjt.values()]
    if kjt.variable_stride_per_key():
        tensors.append(torch.tensor(kjt.stride_per_key(), device=kjt.values().device))
    if kjt.weights_or_none() is not None:
        tensors.append(kjt.weights())
    return tensors


def map_tensors(
    kjt: KeyedJaggedTensor, fn: Callable[[Tensor], Tensor], weights_fn: Callable[[Tensor], Tensor] | None = None
) -> KeyedJaggedTensor:
    """``kjt`` with ``fn`` applied to each tensor it holds (``weights_fn`` to the weights), caches kept."""
    inverse = kjt._inverse_indices
    out = type(kjt).__new__(type(kjt))
    out._init(
        kjt._keys,
        fn(kjt._values),
        None if kjt._weights is None else (weights_fn or fn)(kjt._weights),
        None if kjt._lengths is None else fn(kjt._lengths),
        None if kjt._offsets is None else fn(kjt._offsets),
        kjt._stride,
        kjt._length_per_key,
        kjt._offset_per_key,
        kjt._stride_per_key_per_rank,
        None if inverse is None else (inverse[0], fn(inverse[1])),
    )
    return out


def flatten_lengths(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The same KJT with 1-D lengths (lengths are always stored 1-D here)."""
    return type(kjt)._trusted(
        kjt._keys,
        kjt._values,
        kjt._weights,
        kjt.lengths().reshape(-1),
        kjt._stride,
        kjt.length_per_key(),
        stride_per_key_per_rank=kjt._stride_per_key_per_rank,
    )


def dist_init(
    keys: list[str],
    tensors: list[Tensor],
    variable_stride_per_key: bool,
    num_workers: int,
    recat: Tensor | None,
    stride_per_rank: list[int] | None,
    stagger: int = 1,
) -> KeyedJaggedTensor:
    """The KJT an all-to-all of ``dist_tensors`` delivered (TorchRec's ``KeyedJaggedTensor.dist_init``).

    ``tensors`` hold ``num_workers`` sources one after another, each with every key of ``keys``
    (``[R * K]`` segments); ``recat`` (``[R * K]``, or one entry per bag when sources' batches
    differ) lists them in the order they take in the result, key-major, so key ``k``'s bags are
    every source's bags of it. Fixed batch: ``stride_per_rank`` are the sources' batch sizes.
    """
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor

    labels = 3 if variable_stride_per_key else 2  # lengths, values[, strides], then weights
    if len(tensors) not in (labels, labels + 1):
        raise ValueError(f"dist_init: got {len(tensors)} tensors; expected {labels} or {labels + 1} (with weights)")
    lengths, values = tensors[0], tensors[1]
    weights = tensors[labels] if len(tensors) == labels + 1 else None
    if variable_stride_per_key:
        strides = tensors[2].long()  # bags of each (source, key) segment, source-major
        if strides.numel() != num_workers * len(keys):
            raise ValueError(f"dist_init: {strides.numel()} strides for {num_workers} workers x {len(keys)} keys")
        if recat is not None:
            ids = ops.complete_cumsum(lengths.long(), use_fbgemm=False)
            bounds = ops.complete_cumsum(strides, use_fbgemm=False)
            ids_per_segment = ids[bounds[1:]] - ids[bounds[:-1]]
            lengths = _take_segments(lengths, strides, recat)
            values = _take_segments(values, ids_per_segment, recat)
            weights = None if weights is None else _take_segments(weights, ids_per_segment, recat)
        spkpr = strides.view(num_workers, len(keys)).T.cpu()  # [K, R]
        if stagger > 1:
            spkpr = spkpr[:, torch.arange(num_workers).view(stagger, -1).T.reshape(-1)]
        return KeyedJaggedTensor(keys, values, weights, lengths, stride_per_key_per_rank=spkpr.tolist()).sync()
    if stride_per_rank is None:
        raise ValueError("dist_init: a fixed batch needs stride_per_rank (each source's batch size)")
    if recat is not None:
        stride = stride_per_rank[0]
        bags_per_row = stride if all(s == stride for s in stride_per_rank) else 1  # else recat is per bag
        if bags_per_row > 0:
            rows = lengths.view(-1, bags_per_row)
            rows, values, weights = ops.permute_2d(recat.long(), rows, values, weights)
            lengths = rows.reshape(-1)
    return KeyedJaggedTensor(keys, values, weights, lengths, stride=sum(stride_per_rank)).sync()


def _take_segments(t: Tensor, sizes: Tensor, order: Tensor) -> Tensor:
    """The segments of ``t`` (``sizes[i]`` entries each, in order) concatenated as ``order`` lists them."""
    starts = ops.complete_cumsum(sizes, use_fbgemm=False)[:-1]
    order = order.long()
    return t.index_select(0, ops.gather_index(starts.index_select(0, order), sizes.index_select(0, order)))
