"""Jagged-layout primitives: fbgemm operators where they run, plain torch otherwise.

Both paths return identical results; tests pin them against each other. Every
function here is pure and batched (no Python loop over samples), except the CPU
route of :func:`permute_2d` for a few keys of many ids: one slice per key, cheaper
there than any operator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec._fbgemm import fbgemm_ops_on


def _fbgemm_for(t: Tensor) -> bool:
    # traced (torch.export / torch.compile): torch's ops, so a saved program loads where fbgemm is absent
    return fbgemm_ops_on(t.device.type) and not torch.compiler.is_compiling()


def complete_cumsum(lengths: Tensor, *, use_fbgemm: bool | None = None) -> Tensor:
    """Offsets from lengths: ``[L] -> [L + 1]`` starting at 0.

    >>> complete_cumsum(torch.tensor([2, 0, 1]))
    tensor([0, 2, 2, 3])
    """
    if use_fbgemm is None:
        use_fbgemm = _fbgemm_for(lengths) and lengths.dtype in (torch.int32, torch.int64)
    if use_fbgemm:
        return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def _permute_dtypes_ok(lengths: Tensor, values: Tensor, weights: Tensor | None) -> bool:
    """Dtypes (and 1-D values) fbgemm's ``permute_2D_sparse_data`` has kernels for; others take the torch path."""
    return (
        lengths.dtype in (torch.int32, torch.int64)
        and values.dim() == 1
        and values.dtype in (torch.int32, torch.int64, torch.float32)
        and (weights is None or weights.dtype in (torch.float32, torch.float16, torch.float64))
    )


def permute_2d(
    permute: Tensor,
    lengths: Tensor,
    values: Tensor,
    weights: Tensor | None = None,
    *,
    permuted_values_numel: int | None = None,
    use_fbgemm: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Reorder the key rows of a key-major jagged layout.

    ``lengths`` is ``[K, B]``; new key ``j`` takes old key ``permute[j]`` (keys may be
    dropped or repeated). Returns ``(lengths [K', B], values, weights)``. ``use_fbgemm=None``: on
    CPU, up to :data:`SLICES_UP_TO` keys of :data:`SLICE_MIN_IDS_PER_KEY` ids or more on average, each key's
    values are copied in the new order; else fbgemm's operator where it runs, torch's gather otherwise (all three
    give the same tensors).
    """
    if use_fbgemm is None:
        if _slices_for(permute, lengths, values, weights):
            return _permute_2d_slices(permute, lengths, values, weights)
        use_fbgemm = _fbgemm_for(values) and _permute_dtypes_ok(lengths, values, weights)
    if use_fbgemm:
        out_lengths, out_values, out_weights = torch.ops.fbgemm.permute_2D_sparse_data(
            permute.int(), lengths, values, weights, permuted_values_numel
        )
        return out_lengths, out_values, out_weights
    out_lengths = lengths.index_select(0, permute)
    key_len = lengths.sum(1)
    key_start = complete_cumsum(key_len, use_fbgemm=False)[:-1]
    seg_len = key_len.index_select(0, permute)
    seg_src = key_start.index_select(0, permute)
    index = gather_index(seg_src, seg_len, total=permuted_values_numel)
    out_values = values.index_select(0, index)
    out_weights = None if weights is None else weights.index_select(0, index)
    return out_lengths, out_values, out_weights


#: :func:`permute_2d` copies host tensors key by key for up to this many keys ...
SLICES_UP_TO = 64
#: ... holding at least this many ids per key on average. Measured on an AMD EPYC (AVX-512), one thread, int64
#: ids: a key's slice costs ~1 us of Python, fbgemm's ``permute_2D_sparse_data`` 0.5-1.2 ns an id, torch's gather
#: 2-7 ns (8 keys x 2,048 bags, ~15,000 ids a key: 34 us against fbgemm's 146 and the gather's 301; 64 x 256, ~1,900
#: a key: 81 against 149 and 258; 64 x 64, ~470 a key: 64 against 15 and 70).
SLICE_MIN_IDS_PER_KEY = 1024


def _slices_for(permute: Tensor, lengths: Tensor, values: Tensor, weights: Tensor | None) -> bool:
    """Whether :func:`permute_2d` takes the key-by-key copy: plain CPU tensors (a host read is no device sync),
    in eager mode (not traced: the key sizes are data), few keys holding many ids each."""
    return (
        all(t is None or (type(t) is Tensor and t.device.type == "cpu") for t in (permute, lengths, values, weights))
        and not torch.compiler.is_compiling()  # (before the sizes: no guard on a traced size)
        and permute.numel() <= SLICES_UP_TO
        and values.shape[0] >= SLICE_MIN_IDS_PER_KEY * max(lengths.shape[0], 1)
    )


def _permute_2d_slices(
    permute: Tensor, lengths: Tensor, values: Tensor, weights: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`permute_2d` on the host: each kept key's values copied once, in the new order (the same result)."""
    key_len = lengths.sum(1).tolist()
    start = [0]
    for n in key_len:
        start.append(start[-1] + n)
    order = permute.tolist()

    def take(t: Tensor) -> Tensor:
        return torch.cat([t[start[k] : start[k + 1]] for k in order]) if order else t[:0]

    return lengths.index_select(0, permute.long()), take(values), None if weights is None else take(weights)


def gather_index(starts: Tensor, lengths: Tensor, *, total: int | None = None) -> Tensor:
    """Concatenated ranges ``[starts[i], starts[i] + lengths[i])`` as one index tensor.

    >>> gather_index(torch.tensor([5, 0]), torch.tensor([2, 3]))
    tensor([5, 6, 0, 1, 2])
    """
    starts = starts.long()
    lengths = lengths.long()
    if total is None:
        total = int(lengths.sum())
    new_starts = complete_cumsum(lengths, use_fbgemm=False)[:-1]
    shift = torch.repeat_interleave(starts - new_starts, lengths, output_size=total)
    return torch.arange(total, device=starts.device) + shift


def segment_ids(lengths: Tensor, total: int | None = None) -> Tensor:
    """For each value, the index of the bag it belongs to: ``[2, 0, 1] -> [0, 0, 2]``."""
    bags = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(bags, lengths.long(), output_size=total)


def jagged_to_padded_dense(
    values: Tensor,
    offsets: Tensor,
    max_length: int,
    padding_value: float = 0.0,
    *,
    use_fbgemm: bool | None = None,
) -> Tensor:
    """Bags of ``values`` (``[N]`` or ``[N, D]``) padded/truncated to ``[B, max_length(, D)]``."""
    squeeze = values.dim() == 1
    vals2d = values.unsqueeze(-1) if squeeze else values
    if use_fbgemm is None:
        use_fbgemm = _fbgemm_for(values) and values.is_floating_point()
    if use_fbgemm:
        out = torch.ops.fbgemm.jagged_to_padded_dense(vals2d, [offsets.long()], [max_length], float(padding_value))
    else:
        batch = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        bag = segment_ids(lengths, total=vals2d.shape[0])
        pos = torch.arange(vals2d.shape[0], device=values.device) - offsets[:-1].long()[bag]
        keep = pos < max_length
        out = vals2d.new_full((batch, max_length, vals2d.shape[1]), padding_value)
        out[bag[keep], pos[keep]] = vals2d[keep]
    return out.squeeze(-1) if squeeze else out


def tensor_bytes(*tensors: Tensor | None) -> int:
    """Bytes of the tensors' elements (``numel * element_size``), None skipped: ``size_in_bytes()``."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
