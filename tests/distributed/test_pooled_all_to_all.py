"""``all_to_all_pooled``: the pooled output all-to-all with its column layout fused in.

Forward and backward must be bit-identical to the chain it replaces: all-to-all, the
received blocks side by side, a column gather, and the gradient scaled by ``1 / W``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks
from lightning_shardrec.testing import run_ranks


def test_column_blocks_finds_the_widest_block():
    layout = ColumnBlocks.from_columns([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15], [8, 8])
    assert layout.block == 4
    assert [i.tolist() for i in layout.index] == [[0, 2], [1, 3]]
    identity = ColumnBlocks.from_columns(list(range(12)), [4, 8])
    assert identity.block == 4 and [i.tolist() for i in identity.index] == [[0], [1, 2]]
    odd = ColumnBlocks.from_columns([1, 0, 2], [2, 1])
    assert odd.block == 1 and [i.tolist() for i in odd.index] == [[1, 0], [2]]
    # evenly spaced blocks are copied through a strided slice, the rest by index
    assert layout.slices == [slice(0, 3, 2), slice(1, 4, 2)]
    assert identity.slices == [slice(0, 1, 1), slice(1, 3, 1)]
    assert odd.slices == [None, slice(2, 3, 1)]


def test_column_blocks_rejects_a_non_permutation():
    with pytest.raises(ValueError, match=r"columns must be a permutation of range\(4\), got 3 entries"):
        ColumnBlocks.from_columns([0, 1, 1], [2, 2])


def _exchange(rank, world, batch_sizes, width, columns, gather_above=16):
    from lightning_shardrec.distributed.comm import pooled_all_to_all as pooled
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv, all_to_all_grad, scale_grad
    from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks, all_to_all_pooled

    env = ShardingEnv.from_process_group()
    torch.manual_seed(rank)
    x = torch.randn(sum(batch_sizes), width[rank], requires_grad=True)  # this rank's rows for every source
    b = batch_sizes[rank]
    widths = list(width)
    index = torch.tensor(columns)
    # the reference: what the table-wise output dist did before
    recv = all_to_all_grad(x.reshape(-1), [b * w for w in widths], [bs * width[rank] for bs in batch_sizes], env)
    parts = [p.view(b, w) for p, w in zip(recv.split([b * w for w in widths]), widths, strict=True)]
    ref = scale_grad(torch.cat(parts, dim=1).index_select(1, index), 1.0 / world)
    grad = torch.randn(b, 2 * sum(widths))[:, ::2]  # a strided gradient, as a column slice delivers
    ref.backward(grad)
    ref_grad, x.grad = x.grad.clone(), None
    saved, pooled.GATHER_ABOVE = pooled.GATHER_ABOVE, gather_above  # 0: the block gather of many sources
    try:
        out = all_to_all_pooled(x, batch_sizes, ColumnBlocks.from_columns(columns, widths), 1.0 / world, env)
        out.backward(grad)
    finally:
        pooled.GATHER_ABOVE = saved
    return torch.equal(out, ref), torch.equal(x.grad, ref_grad)


@pytest.mark.parametrize(
    ("world", "batch_sizes", "width", "columns"),
    [
        (1, [3], [8], [4, 5, 6, 7, 0, 1, 2, 3]),
        (2, [3, 5], [8, 8], [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]),
        (3, [2, 0, 4], [2, 3, 1], [5, 0, 1, 2, 3, 4]),
    ],
)
@pytest.mark.parametrize("gather_above", [16, 0])
def test_pooled_all_to_all_matches_the_unfused_chain(world, batch_sizes, width, columns, gather_above):
    results = run_ranks(_exchange, world, batch_sizes, width, columns, gather_above)
    for rank, (same_out, same_grad) in enumerate(results):
        assert same_out, f"rank {rank}: forward differs"
        assert same_grad, f"rank {rank}: gradient differs"


def _reduce_scatter(rank, world, rows):
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv, reduce_scatter_grad, reduce_scatter_rows

    env = ShardingEnv.from_process_group()
    torch.manual_seed(rank)
    x = torch.randn(sum(rows), 3, requires_grad=True)
    grad = torch.randn(rows[rank], 3)
    ref = reduce_scatter_grad(list(x.split(rows)), env)  # the list form: reduce-scatter, backward all-to-all
    ref.backward(grad)
    ref_grad, x.grad = x.grad.clone(), None
    out = reduce_scatter_rows(x, rows, env)
    out.backward(grad)
    # the single-tensor reduce-scatter may add the ranks' parts in another order: equal within rounding
    return torch.allclose(out, ref, rtol=1e-6, atol=1e-6), torch.equal(x.grad, ref_grad)


@pytest.mark.parametrize(("world", "rows"), [(2, [3, 3]), (3, [2, 0, 4]), (3, [4, 4, 4])])
def test_reduce_scatter_rows_matches_the_list_form(world, rows):
    for rank, (same_out, same_grad) in enumerate(run_ranks(_reduce_scatter, world, rows)):
        assert same_out, f"rank {rank}: forward differs"
        assert same_grad, f"rank {rank}: gradient differs"
