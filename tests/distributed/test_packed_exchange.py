"""``exchange_packed_async``: every group's lengths, ids and weights in one all-to-all of bytes.

It must give, bit for bit, the KJTs the per-group all-to-alls (:func:`exchange`) give, for any
dtypes (int32 or int64 lengths and ids, fp32 or fp16 weights, none), uneven batch sizes and empty
pieces; and ``merged_layout`` must place several groups' pooled columns as their own layouts do.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks, merged_layout
from lightning_shardrec.testing import run_ranks

#: per group: (keys, lengths dtype, ids dtype, weights dtype or None)
GROUPS = [
    (2, torch.int32, torch.int64, None),
    (1, torch.int64, torch.int32, torch.float32),
    (3, torch.int64, torch.int64, torch.float16),
]


def _routed(rank: int, world: int, keys: int, dtypes: tuple, batch: int, seed: int):
    from lightning_shardrec.distributed.comm.input_dist import Routed

    g = torch.Generator().manual_seed(100 * seed + rank)
    lengths_dt, ids_dt, weights_dt = dtypes
    lengths = torch.randint(0, 4, (world * keys * batch,), generator=g)
    lengths[: keys * batch] = 0  # an empty piece for destination 0
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
    weights = None if weights_dt is None else torch.rand(values.numel(), generator=g).to(weights_dt)
    value_splits = [int(s) for s in lengths.view(world, -1).sum(1)]
    return Routed(lengths.to(lengths_dt), values.to(ids_dt), weights, [keys * batch] * world, value_splits)


def _compare(rank: int, world: int) -> None:
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv, all_to_all
    from lightning_shardrec.distributed.comm.input_dist import exchange, exchange_packed_async

    env = ShardingEnv.from_process_group()
    batch_sizes = [2 + r for r in range(world)]  # uneven
    routed = [_routed(rank, world, k, dts, batch_sizes[rank], i) for i, (k, *dts) in enumerate(GROUPS)]
    # every rank's id counts for this rank (what the header carries)
    sent = torch.tensor([r.value_splits for r in routed], dtype=torch.long).t().contiguous()  # [W, G]
    recv_values = all_to_all(sent, [1] * world, [1] * world, env).t().tolist()
    keys = [k for k, *_ in GROUPS]
    want = [exchange(r, v, k, batch_sizes, env) for r, v, k in zip(routed, recv_values, keys, strict=True)]
    got = exchange_packed_async(routed, recv_values, keys, batch_sizes, env).wait()
    for w, o in zip(want, got, strict=True):
        for a, b in [(w.lengths(), o.lengths()), (w.values(), o.values())]:
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert (w.weights_or_none() is None) == (o.weights_or_none() is None)
        if w.weights_or_none() is not None:
            assert torch.equal(w.weights().view(torch.uint8), o.weights().view(torch.uint8))


@pytest.mark.parametrize("world", [2, 3])
def test_packed_exchange_equals_the_per_group_all_to_alls(world: int) -> None:
    run_ranks(_compare, world)


def test_merged_layout_places_each_group_as_its_own_layout() -> None:
    a = ColumnBlocks.from_columns([4, 5, 0, 1, 2, 3], [4, 2])  # source 1's two columns first
    b = ColumnBlocks.from_columns([2, 0, 1], [1, 2])
    merged = merged_layout([a, b])
    assert merged.widths == [5, 4]
    torch.manual_seed(0)
    # per source s, its rows: group a's columns then group b's
    rows = [torch.randn(3, w) for w in merged.widths]
    side = torch.cat(rows, 1)
    out = side[:, [merged_columns(merged)[j] for j in range(9)]]
    a_in = torch.cat([rows[0][:, :4], rows[1][:, :2]], 1)
    b_in = torch.cat([rows[0][:, 4:], rows[1][:, 2:]], 1)
    want = torch.cat([a_in[:, merged_columns(a)], b_in[:, merged_columns(b)]], 1)
    assert torch.equal(out, want)


def merged_columns(layout: ColumnBlocks) -> list[int]:
    """Output column ``j`` <- input column ``columns[j]`` of the sources side by side (``from_columns``'s input)."""
    starts = [sum(layout.widths[:s]) for s in range(len(layout.widths))]
    columns = [0] * sum(layout.widths)
    for s, blocks in enumerate(layout.index):
        for k, block in enumerate(blocks.tolist()):
            for c in range(layout.block):
                columns[block * layout.block + c] = starts[s] + k * layout.block + c
    return columns
