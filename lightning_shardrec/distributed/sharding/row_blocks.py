"""Row-wise, table-row-wise and grid sharding: row blocks of a table, or of its column pieces.

Each id is sent only to the rank owning its row block, rebased to the block's
first row (weights travel along). Every rank pools its partial sums for the global
batch, ``[sum_s B_s, D]``, and a reduce-scatter adds the partials of source ``s``'s
bags onto ``s``. Pooling is linear, so the sum of partial sums is the full sum;
MEAN divides by the whole bag's length afterwards, on the source rank.

Table-row-wise and grid tables (every block of a table, or of a column piece, on
one host) route ids the same way; their pooled output is summed among the blocks' holders
(:class:`~lightning_shardrec.distributed.sharding.host_blocks.HostRowBlockSharding`).
Grid tables are cut into column pieces first, and each piece is row-blocked: the piece
is a sub-table, and each feature of a grid table becomes one *lane* per piece (its
ids sent once per piece, to that piece's block). A lane's partial fills only its
piece's columns of the feature, so the reduction assembles the full width::

    feature f of a 2 x 2 grid table (dim 8):  lanes (f, cols 0:4) and (f, cols 4:8)
    id 7 of f -> the block of piece 0 holding row 7, and the block of piece 1 holding row 7

Sequence tables: every id went to exactly one rank per lane, so each rank sends
the rows of source ``s``'s ids back to ``s`` by the reverse all-to-all, and ``s``
undoes the sort by destination of :func:`route_by_row` to restore its ids' order
and puts each feature's pieces side by side.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import (
    ShardingEnv,
    all_to_all_grad,
    reduce_scatter_rows,
    scale_grad,
)
from lightning_shardrec.distributed.comm.input_dist import Routed, RowBlocks, exchange, route_by_row, source_major
from lightning_shardrec.distributed.sharding.base import (
    EmbeddingSharding,
    KernelSetup,
    SequenceDist,
    TableSharding,
)
from lightning_shardrec.planner import ShardMetadata
from lightning_shardrec.sparse import KeyedJaggedTensor


class RowBlockSharding(EmbeddingSharding):
    """Row-wise tables of one collection (and the id routing of table-row-wise and grid)."""

    _columns: Tensor  # buffer: this rank's output columns, in the collection's order

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        super().__init__(tables, env, setup)
        # Sub-tables: (table, column piece) with the piece's shards in row order.
        subs: list[tuple[int, list[ShardMetadata]]] = []
        for t_idx, t in enumerate(tables):
            pieces: dict[int, list[ShardMetadata]] = {}
            for shard in t.plan.shards:
                pieces.setdefault(shard.shard_offsets[1], []).append(shard)
            for col0 in sorted(pieces):
                subs.append((t_idx, sorted(pieces[col0], key=lambda s: s.shard_offsets[0])))
        # Lanes: one per (group feature, piece of its table), piece-major (a kernel's features
        # of one table stay contiguous), pieces of a table by column.
        lanes = [(f, i) for i, (t, _) in enumerate(subs) for f, ft in enumerate(self.feature_table) if t == ft]
        self._expand = [f for f, _ in lanes]
        base: list[int] = []
        starts: list[int] = []
        row_start: list[int] = []
        ranks: list[int] = []
        local: list[tuple[TableSharding, ShardMetadata]] = []
        local_block_of_sub: dict[int, int] = {}
        total = 0
        for i, (t_idx, shards) in enumerate(subs):
            base.append(total)
            for shard in shards:
                starts.append(total + shard.shard_offsets[0])
                row_start.append(shard.shard_offsets[0])
                ranks.append(shard.rank)
                if shard.rank == env.rank:
                    local_block_of_sub[i] = len(local)
                    local.append((tables[t_idx], shard))
            total += tables[t_idx].config.num_embeddings
        device = setup.device
        self.blocks = RowBlocks(
            table_base=torch.tensor(base, device=device),
            starts=torch.tensor(starts, device=device),
            row_start=torch.tensor(row_start, device=device),
            rank=torch.tensor(ranks, device=device),
            whole_tables=len(starts) == len(subs) and not any(row_start),
        )
        self._lane_sub_t = torch.tensor([i for _, i in lanes], device=device)
        # Lanes whose piece has a block here, and where their columns go in the group output.
        self.local_lanes = [j for j, (_, i) in enumerate(lanes) if i in local_block_of_sub]
        self.build_kernel(local, [local_block_of_sub[lanes[j][1]] for j in self.local_lanes])
        offsets = [0]
        for d in self.feature_dims:
            offsets.append(offsets[-1] + d)
        self.width = offsets[-1]
        #: per lane: its columns of the group output, and the ranks holding a block of its piece
        self.lane_columns: list[list[int]] = []
        self.lane_ranks: list[set[int]] = []
        for f, i in lanes:
            first = subs[i][1][0]
            c0 = offsets[f] + first.shard_offsets[1]
            self.lane_columns.append(list(range(c0, c0 + first.shard_sizes[1])))
            self.lane_ranks.append({s.rank for s in subs[i][1]})
        cols = [c for j in self.local_lanes for c in self.lane_columns[j]]
        self._lanes = lanes
        self._identity = self._expand == list(range(len(self.feature_names)))
        self._every_lane = self.local_lanes == list(range(len(lanes)))
        self._all_local = self._every_lane and cols == list(range(self.width))
        self.register_buffer("_columns", torch.tensor(cols, dtype=torch.long, device=device), persistent=False)

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        lanes = kjt if self._identity else kjt.permute(self._expand)
        return route_by_row(lanes, self._lane_sub_t, self.blocks, self.env.world_size)

    def input_dist(
        self, kjt: KeyedJaggedTensor, routed: Routed | None, recv_values: list[int], batch_sizes: list[int]
    ) -> KeyedJaggedTensor:
        received = exchange(routed, recv_values, self.received_keys(), batch_sizes, self.env)  # type: ignore[arg-type]
        return self.after_exchange(received)

    def received_keys(self) -> int:
        return len(self._lanes)

    def after_exchange(self, received: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if self.kernel is None or self._every_lane:
            return received
        return received.permute(self.local_lanes)

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
        pooled = reduce_scatter_rows(out, batch_sizes, self.env, self.comm_precision)
        return scale_grad(pooled, 1.0 / self.env.world_size)

    def output_dist_sequence(self, rows: Tensor, ctx: SequenceDist) -> list[Tensor]:
        # Keys this rank owns no block of received no ids, so dropping them in input_dist
        # left the rows in (key, source, sample) order of the kept keys.
        received = ctx.received
        index = source_major(received.lengths(), len(received.keys()), ctx.batch_sizes, rows.shape[0])
        if index is not None:
            rows = rows.index_select(0, index)
        routed = ctx.routed
        if routed is None or routed.order is None:  # pragma: no cover - row-wise routing keeps the ids' order
            raise RuntimeError("RowBlockSharding: the input distribution kept no id order for the sequence output")
        back = all_to_all_grad(rows, routed.value_splits, ctx.recv_values, self.env, self.comm_precision)
        order = routed.order
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        back = scale_grad(back.index_select(0, inverse), 1.0 / self.env.world_size)
        lpk = ctx.local.length_per_key()
        blocks = back.split([lpk[f] for f in self._expand])
        if self._identity:
            return list(blocks)
        per_feature: list[list[Tensor]] = [[] for _ in self.feature_names]
        for (f, _), block in zip(self._lanes, blocks, strict=True):
            per_feature[f].append(block)
        return [b[0] if len(b) == 1 else torch.cat(b, dim=1) for b in per_feature]
