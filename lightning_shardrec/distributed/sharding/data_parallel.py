"""Data-parallel tables: every rank holds the whole table; no ids cross the wire.

The weights are ordinary parameters (``embedding_bags.<table>.weight``), so DDP
averages their gradients across ranks and the user's dense optimizer steps them,
as for any replicated layer. Worth it only for small tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.input_dist import Routed
from lightning_shardrec.distributed.sharding.base import (
    EmbeddingSharding,
    KernelSetup,
    SequenceDist,
    TableSharding,
    shard_init,
)
from lightning_shardrec.planner import ShardMetadata
from lightning_shardrec.sparse import KeyedJaggedTensor


class DataParallelSharding(EmbeddingSharding):
    """Replicated tables, looked up locally with autograd (dense gradients)."""

    fused = False

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        super().__init__(tables, env, setup)
        # One per table, in ``tables`` order (a list: a ParameterDict rejects table names such as ``items``).
        self.weights = nn.ParameterList()
        for t in tables:
            full = ShardMetadata((0, 0), (t.config.num_embeddings, t.config.embedding_dim), env.rank)
            self.weights.append(nn.Parameter(shard_init(t, full, setup.device).clone()))

    def route(self, kjt: KeyedJaggedTensor) -> Routed | None:
        return None

    def input_dist(
        self, kjt: KeyedJaggedTensor, routed: Routed | None, recv_values: list[int], batch_sizes: list[int]
    ) -> KeyedJaggedTensor:
        return kjt

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        subs = kjt.split([t.config.num_features for t in self.tables])
        if not self.setup.pooled:  # one row per id, in the KJT's (key, bag) order
            per_table = [F.embedding(sub.values().long(), w) for w, sub in zip(self.weights, subs, strict=True)]
            return per_table[0] if len(per_table) == 1 else torch.cat(per_table)
        outs = []
        for t, w, sub in zip(self.tables, self.weights, subs, strict=True):
            rows = F.embedding_bag(
                sub.values().long(),
                w,
                sub.offsets().long(),
                mode="sum",
                per_sample_weights=sub.weights_or_none(),
                include_last_offset=True,
            )
            n = t.config.num_features
            d = t.config.embedding_dim
            outs.append(rows.view(n, sub.stride(), d).transpose(0, 1).reshape(sub.stride(), n * d))
        return torch.cat(outs, dim=1)

    def output_dist(self, out: Tensor, batch_sizes: list[int]) -> Tensor:
        return out

    def output_dist_sequence(self, rows: Tensor, ctx: SequenceDist) -> list[Tensor]:
        return list(rows.split(ctx.local.length_per_key()))

    def local_shards(self) -> list[tuple[str, ShardMetadata, Tensor]]:
        return [
            (t.config.name, ShardMetadata((0, 0), tuple(p.shape), self.env.rank), p.detach())  # type: ignore[arg-type]
            for t, p in zip(self.tables, self.weights, strict=True)
        ]
