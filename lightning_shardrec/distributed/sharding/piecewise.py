"""Table-wise and column-wise sharding: every shard holds all rows of some columns.

A table-wise table is one piece (all columns) on one rank; a column-wise table is
several pieces, each a column range on some rank. A feature's ids go, whole, to
every rank holding a piece of its table (duplicated for column-wise); each piece
pools its columns for the global batch and sends ``[B_s, width]`` back to source
``s``, which puts the pieces of each feature side by side in column order::

    rank 0 (piece t[:, 0:8])  --[B_r, 8]--\\
                                           >-- [B_r, 16] for feature f on rank r
    rank 1 (piece t[:, 8:16]) --[B_r, 8]--/

Sequence tables: each piece returns one row per id instead, ``[N_s, width]`` to
source ``s`` (its ids in the order it sent them), and the source puts a feature's
pieces side by side the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import ShardingEnv, all_to_all_grad, scale_grad
from lightning_shardrec.distributed.comm.input_dist import Routed, exchange, route_by_key, source_major
from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks, all_to_all_pooled
from lightning_shardrec.distributed.sharding.base import (
    EmbeddingSharding,
    KernelSetup,
    SequenceDist,
    TableSharding,
)
from lightning_shardrec.sparse import KeyedJaggedTensor


class PiecewiseSharding(EmbeddingSharding):
    """Table-wise (one piece per table) and column-wise (column pieces) tables."""

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        super().__init__(tables, env, setup)
        world = env.world_size
        # Pieces per rank, in (table, column) order; a piece serves every feature of its table.
        keys_per_dest: list[list[int]] = [[] for _ in range(world)]
        widths_per_dest: list[list[int]] = [[] for _ in range(world)]
        where: dict[tuple[int, int], tuple[int, int]] = {}  # (feature, piece col) -> (dest, slot)
        local, local_features = [], []
        for t_idx, t in enumerate(tables):
            features = [f for f, ft in enumerate(self.feature_table) if ft == t_idx]
            for shard in sorted(t.plan.shards, key=lambda s: s.shard_offsets[1]):
                d = shard.rank
                if d == env.rank:
                    local.append((t, shard))
                for f in features:
                    where[(f, shard.shard_offsets[1])] = (d, len(keys_per_dest[d]))
                    keys_per_dest[d].append(f)
                    widths_per_dest[d].append(shard.shard_sizes[1])
                    if d == env.rank:
                        local_features.append(len(local) - 1)
        self.keys_per_dest = keys_per_dest
        self.recv_widths = [sum(w) for w in widths_per_dest]  # columns each rank sends back
        self.build_kernel(local, local_features)
        # Column index: received [B_r, sum over ranks of widths] -> group feature order.
        starts = [0] * world
        for d in range(1, world):
            starts[d] = starts[d - 1] + self.recv_widths[d - 1]
        slot_start: dict[tuple[int, int], int] = {}
        for d in range(world):
            col = starts[d]
            for slot, w in enumerate(widths_per_dest[d]):
                slot_start[(d, slot)] = col
                col += w
        index: list[int] = []
        for _feature_col, (d, slot) in sorted(where.items()):
            width = widths_per_dest[d][slot]
            index.extend(range(slot_start[(d, slot)], slot_start[(d, slot)] + width))
        # received [B_r, width from rank d] blocks -> group feature order, in one copy
        self._layout = ColumnBlocks.from_columns(index, self.recv_widths, setup.device)
        # Sequence: per feature, its pieces' blocks in the routed order, by column.
        first_block = [sum(len(k) for k in keys_per_dest[:d]) for d in range(world)]
        self._blocks_of: list[list[int]] = [[] for _ in self.feature_names]
        for (f, _col), (d, slot) in sorted(where.items()):
            self._blocks_of[f].append(first_block[d] + slot)

    @property
    def pooled_layout(self) -> ColumnBlocks:
        """Where each source's pooled columns land in this group's output (its output all-to-all's layout)."""
        return self._layout

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        return route_by_key(kjt, self.keys_per_dest)

    def input_dist(
        self, kjt: KeyedJaggedTensor, routed: Routed | None, recv_values: list[int], batch_sizes: list[int]
    ) -> KeyedJaggedTensor:
        return exchange(routed, recv_values, self.received_keys(), batch_sizes, self.env)  # type: ignore[arg-type]

    def received_keys(self) -> int:
        return len(self.keys_per_dest[self.env.rank])

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        if self.kernel is None:
            if not self.setup.pooled:
                return self.empty_output(0, self.seq_width)
            return self.empty_output(kjt.stride(), 0)
        return self.kernel(kjt)

    def output_dist(self, out: Tensor, batch_sizes: list[int]) -> Tensor:
        scale = 1.0 / self.env.world_size
        return all_to_all_pooled(out, batch_sizes, self._layout, scale, self.env, self.comm_precision)

    def output_dist_sequence(self, rows: Tensor, ctx: SequenceDist) -> list[Tensor]:
        received = ctx.received
        index = source_major(received.lengths(), len(received.keys()), ctx.batch_sizes, rows.shape[0])
        if index is not None:
            rows = rows.index_select(0, index)
        # reverse of the id all-to-all: each source gets its ids' rows in the order it sent them
        routed = ctx.routed
        back = all_to_all_grad(rows, routed.value_splits, ctx.recv_values, self.env, self.comm_precision)  # type: ignore[union-attr]
        back = scale_grad(back, 1.0 / self.env.world_size)
        lpk = ctx.local.length_per_key()
        blocks = back.split([lpk[k] for keys in self.keys_per_dest for k in keys])
        return [blocks[b[0]] if len(b) == 1 else torch.cat([blocks[i] for i in b], dim=1) for b in self._blocks_of]
