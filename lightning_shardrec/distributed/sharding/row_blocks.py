"""Row-wise and table-row-wise sharding: a table's rows cut into contiguous blocks.

Each id is sent only to the rank owning its row block, rebased to the block's
first row (weights travel along). Every rank pools its partial sums for the global
batch, ``[sum_s B_s, D]``, and a reduce-scatter adds the partials of source ``s``'s
bags onto ``s``. Pooling is linear, so the sum of partial sums is the full sum;
MEAN divides by the whole bag's length afterwards, on the source rank.

Table-row-wise is the same mechanism with every block of a table on one host.

Sequence tables: every id went to exactly one rank, so each rank sends the rows
of source ``s``'s ids back to ``s`` by the reverse all-to-all, and ``s`` undoes the
sort by destination of :func:`route_by_row` to restore its ids' order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm import ShardingEnv, all_to_all_grad, reduce_scatter_grad, scale_grad
from lightning_shardrec.distributed.input_dist import Routed, RowBlocks, exchange, route_by_row, source_major
from lightning_shardrec.distributed.sharding.base import (
    EmbeddingSharding,
    KernelSetup,
    SequenceDist,
    TableSharding,
)
from lightning_shardrec.sparse import KeyedJaggedTensor


class RowBlockSharding(EmbeddingSharding):
    """Row-wise and table-row-wise tables of one collection."""

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        super().__init__(tables, env, setup)
        base, starts, row_start, ranks = [], [], [], []
        local, local_block_of_table = [], {}
        total = 0
        for t_idx, t in enumerate(tables):
            base.append(total)
            for shard in sorted(t.plan.shards, key=lambda s: s.shard_offsets[0]):
                r0 = shard.shard_offsets[0]
                starts.append(total + r0)
                row_start.append(r0)
                ranks.append(shard.rank)
                if shard.rank == env.rank:
                    local_block_of_table[t_idx] = len(local)
                    local.append((t, shard))
            total += t.config.num_embeddings
        device = setup.device
        self.blocks = RowBlocks(
            table_base=torch.tensor(base, device=device),
            starts=torch.tensor(starts, device=device),
            row_start=torch.tensor(row_start, device=device),
            rank=torch.tensor(ranks, device=device),
        )
        self._feature_table_t = torch.tensor(self.feature_table, device=device)
        # Features whose table has a block here, and where their columns go in the group output.
        self.local_features = [f for f, t in enumerate(self.feature_table) if t in local_block_of_table]
        self.build_kernel(local, [local_block_of_table[self.feature_table[f]] for f in self.local_features])
        offsets = [0]
        for d in self.feature_dims:
            offsets.append(offsets[-1] + d)
        self.width = offsets[-1]
        cols = [c for f in self.local_features for c in range(offsets[f], offsets[f + 1])]
        self._all_local = self.local_features == list(range(len(self.feature_names)))
        self.register_buffer("_columns", torch.tensor(cols, dtype=torch.long, device=device), persistent=False)

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        return route_by_row(kjt, self._feature_table_t, self.blocks, self.env.world_size)

    def input_dist(
        self, kjt: KeyedJaggedTensor, routed: Routed | None, recv_values: list[int], batch_sizes: list[int]
    ) -> KeyedJaggedTensor:
        received = exchange(routed, recv_values, self.received_keys(), batch_sizes, self.env)  # type: ignore[arg-type]
        return self.after_exchange(received)

    def received_keys(self) -> int:
        return len(self.feature_names)

    def after_exchange(self, received: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if self._all_local or self.kernel is None:
            return received
        return received.permute(self.local_features)

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        if not self.setup.pooled:  # one row per id; a rank without blocks received none
            return self.empty_output(0, self.seq_width) if self.kernel is None else self.kernel(kjt)
        rows = kjt.stride()
        if self.kernel is None:
            return self.empty_output(rows, self.width)
        out = self.kernel(kjt)
        if self._all_local:
            return out
        return out.new_zeros(rows, self.width).index_copy(1, self._columns, out)

    def output_dist(self, out: Tensor, batch_sizes: list[int]) -> Tensor:
        pooled = reduce_scatter_grad(list(out.split(batch_sizes)), self.env)
        return scale_grad(pooled, 1.0 / self.env.world_size)

    def output_dist_sequence(self, rows: Tensor, ctx: SequenceDist) -> list[Tensor]:
        # Keys this rank owns no block of received no ids, so dropping them in input_dist
        # left the rows in (key, source, sample) order of the kept keys.
        received = ctx.received
        index = source_major(received.lengths(), len(received.keys()), ctx.batch_sizes, rows.shape[0])
        if index is not None:
            rows = rows.index_select(0, index)
        routed = ctx.routed
        back = all_to_all_grad(rows, routed.value_splits, ctx.recv_values, self.env)  # type: ignore[union-attr]
        order = routed.order  # type: ignore[union-attr]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        back = scale_grad(back.index_select(0, inverse), 1.0 / self.env.world_size)
        return list(back.split(ctx.local.length_per_key()))
