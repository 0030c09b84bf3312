"""The pooled-embedding output all-to-all of table- and column-wise shardings, its column layout fused in.

Every source sends each destination its ``[B_dst, cols]`` pooled rows; the receiver
places the blocks into its ``[B, width]`` output by :class:`ColumnBlocks` (strided copies
for evenly spaced blocks, one gather above 16 sources). Backward is the reverse
all-to-all of the gradient, in the same precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm.bounded_cache import BoundedCache
from lightning_shardrec.distributed.comm.collectives import ShardingEnv, all_to_all_single, exchange_flat
from lightning_shardrec.distributed.comm.qcomm import CommPrecision, WirePrecision, directions


@dataclass(frozen=True)
class ColumnBlocks:
    """Where the columns received from each source go in a pooled output, in blocks of ``block`` columns.

    The received rows of source ``s`` are ``[B, widths[s]]``; output block ``index[s][j]``
    (``[B, block]``) is their block ``j``. Together the sources fill every output block once::

        widths [8, 8], block 4, index [[0, 2], [1, 3]]:  out = [s0[:, 0:4], s1[:, 0:4], s0[:, 4:8], s1[:, 4:8]]
    """

    block: int
    widths: list[int]
    index: list[Tensor]  # per source, [widths[s] // block] output blocks
    # per source, the same blocks as a slice when they are evenly spaced (a strided copy is
    # about 2x an index_copy_ along dim 1 on CPU); None otherwise
    slices: list[slice | None] = field(default_factory=list)
    #: (batch size, device) -> the block gathers of :meth:`gathers`, built once per batch size (the recent ones)
    _gathers: BoundedCache[tuple[Tensor, Tensor]] = field(default_factory=BoundedCache, compare=False, repr=False)

    def gathers(self, b: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(forward, backward)`` block-row indices for ``b`` rows: ``out = recv[forward]``, ``back = out[backward]``.

        ``recv`` and ``out`` seen as rows of ``block`` columns (``[sum_s b * widths[s] / block, block]``
        and ``[b * D / block, block]``): one index op instead of one copy per source.
        """
        return self._gathers.get((b, device), lambda: self._make_gathers(b, device))

    def _make_gathers(self, b: int, device: torch.device) -> tuple[Tensor, Tensor]:
        n = torch.tensor([w // self.block for w in self.widths])
        base = torch.cumsum(n * b, 0) - n * b  # first block row of each source in recv
        per = torch.repeat_interleave(torch.arange(len(n)), n)  # source of each block column
        j = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        place = torch.cat([i.cpu() for i in self.index])  # output block of each block column
        rows = torch.arange(b).unsqueeze(1)
        recv_pos = (base[per] + rows * n[per] + j).reshape(-1)
        out_pos = (rows * place.numel() + place).reshape(-1)
        forward, backward = torch.empty_like(recv_pos), torch.empty_like(out_pos)
        forward[out_pos] = recv_pos
        backward[recv_pos] = out_pos
        return forward.to(device), backward.to(device)

    def __post_init__(self) -> None:
        if not self.slices:
            object.__setattr__(self, "slices", [_as_slice(i.tolist()) for i in self.index])

    @staticmethod
    def from_columns(columns: list[int], widths: list[int], device: torch.device | None = None) -> ColumnBlocks:
        """From ``columns``: output column ``j`` is column ``columns[j]`` of the sources' rows side by side."""
        if sorted(columns) != list(range(sum(widths))):
            raise ValueError(f"columns must be a permutation of range({sum(widths)}), got {len(columns)} entries")
        # the widest block that keeps every run of consecutive columns and every source edge whole
        block = 0
        for j, c in enumerate(columns):
            if j == 0 or c != columns[j - 1] + 1:
                block = math.gcd(block, j, c)
        block = math.gcd(block, len(columns), *widths) or 1
        starts = [0]
        for w in widths:
            starts.append(starts[-1] + w)
        out_block = {columns[j] // block: j // block for j in range(0, len(columns), block)}
        blocks = [range(starts[s] // block, starts[s + 1] // block) for s in range(len(widths))]
        index = [torch.tensor([out_block[b] for b in bs], dtype=torch.long, device=device) for bs in blocks]
        return ColumnBlocks(block, list(widths), index)


def merged_layout(layouts: list[ColumnBlocks]) -> ColumnBlocks:
    """One layout for several groups' pooled all-to-alls sent as one: each source sends, per row, group
    0's columns, then group 1's, ...; the output is the groups' outputs side by side, in that order."""
    world = len(layouts[0].widths)
    base = [0]
    for layout in layouts:
        base.append(base[-1] + sum(layout.widths))
    columns = [0] * base[-1]
    col = 0
    for s in range(world):
        for g, layout in enumerate(layouts):
            blocks = layout.index[s].tolist()
            for c in range(layout.widths[s]):
                columns[base[g] + blocks[c // layout.block] * layout.block + c % layout.block] = col
                col += 1
    widths = [sum(layout.widths[s] for layout in layouts) for s in range(world)]
    return ColumnBlocks.from_columns(columns, widths, layouts[0].index[0].device)


def _as_slice(blocks: list[int]) -> slice | None:
    """``[2, 5, 8] -> slice(2, 9, 3)``; None unless the blocks are evenly spaced and ascending."""
    if not blocks:
        return None
    step = blocks[1] - blocks[0] if len(blocks) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(blocks, blocks[1:], strict=False)):
        return None
    return slice(blocks[0], blocks[-1] + 1, step)


def all_to_all_pooled(
    x: Tensor,
    batch_sizes: list[int],
    layout: ColumnBlocks,
    grad_scale: float,
    env: ShardingEnv,
    precision: CommPrecision | WirePrecision = CommPrecision.FP32,
) -> Tensor:
    """Pooled rows home in one step: ``x [sum_s B_s, w]`` (rows for source ``s`` in order) -> ``[B_r, D]``.

    Source ``s`` sends this rank ``[B_r, layout.widths[s]]``; the columns land in
    ``layout`` order with one copy (no cat, no column gather). Backward gathers the
    gradient straight into the send buffer, times ``grad_scale``, and sends it back.
    ``precision`` below fp32: both directions travel in bf16/fp16 (:mod:`.qcomm`); a
    :class:`~.qcomm.WirePrecision` sends the rows in its ``forward``, the gradient in its ``backward`` format.
    """
    return _PooledAllToAll.apply(x, batch_sizes, layout, grad_scale, env, precision)


# Sources above which the pooled all-to-all places columns with one block gather instead of
# one copy per source (a copy per source is the cheaper below; Python overhead grows with W above).
GATHER_ABOVE = 16


class _PooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: Tensor,
        batch_sizes: list[int],
        layout: ColumnBlocks,
        scale: float,
        env: ShardingEnv,
        precisions: CommPrecision | WirePrecision,
    ) -> Tensor:
        precision, backward = directions(precisions)
        b, width, g = batch_sizes[env.rank], x.shape[1], layout.block
        recv_splits = [b * w for w in layout.widths]
        send_splits = [bs * width for bs in batch_sizes]
        ctx.args = (b, layout, scale, env, recv_splits, send_splits, x.shape, backward)
        if env.world_size == 1:
            recv = x.reshape(-1)
        elif precision is not CommPrecision.FP32:
            recv = exchange_flat(x.contiguous().reshape(-1), recv_splits, send_splits, env, precision)
        else:
            recv = x.new_empty(sum(recv_splits))
            all_to_all_single(recv, x.contiguous().reshape(-1), recv_splits, send_splits, env)
        if len(layout.widths) > GATHER_ABOVE:
            forward, _ = layout.gathers(b, x.device)
            return recv.view(-1, g).index_select(0, forward).view(b, sum(layout.widths))
        out = x.new_empty(b, sum(layout.widths) // g, g)
        for part, w, index, sl in zip(recv.split(recv_splits), layout.widths, layout.index, layout.slices, strict=True):
            if sl is None:
                out.index_copy_(1, index, part.view(b, w // g, g))
            else:
                out[:, sl].copy_(part.view(b, w // g, g))
        return out.view(b, sum(layout.widths))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:  # type: ignore[override]
        b, layout, scale, env, recv_splits, send_splits, shape, precision = ctx.args
        g = layout.block
        grad = grad.reshape(b, sum(layout.widths) // g, g)  # a view, also of a column slice of a wider gradient
        if len(layout.widths) > GATHER_ABOVE:
            _, backward = layout.gathers(b, grad.device)
            back = grad.reshape(-1, g).index_select(0, backward).view(-1)
            if scale != 1.0:
                back.mul_(scale)
        else:
            back = grad.new_empty(sum(recv_splits))
            for part, w, index, sl in zip(
                back.split(recv_splits), layout.widths, layout.index, layout.slices, strict=True
            ):
                dst = part.view(b, w // g, g)
                if sl is None:
                    torch.index_select(grad, 1, index, out=dst)
                    if scale != 1.0:
                        dst.mul_(scale)
                elif scale != 1.0:  # the scale in the copy: one pass over the gradient, the same product
                    torch.mul(grad[:, sl], scale, out=dst)
                else:
                    dst.copy_(grad[:, sl])
        if env.world_size == 1:
            return back.view(shape), None, None, None, None, None
        if precision is not CommPrecision.FP32:
            back = exchange_flat(back, send_splits, recv_splits, env, precision)
            return back.view(shape), None, None, None, None, None
        out = back.new_empty(sum(send_splits))
        all_to_all_single(out, back, send_splits, recv_splits, env)
        return out.view(shape), None, None, None, None, None
