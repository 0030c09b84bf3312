"""What every sharding type provides: ``route -> input_dist -> compute -> output_dist``.

A sharding instance owns one group of tables of a collection (those whose plans
share a mechanism) and this rank's shards of them. The sharded collection drives
the stages; one header all-to-all per batch (in the collection) tells every
group how many ids each source sends and each source's batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import BaseEmbeddingConfig, FusedOptimConfig
from lightning_shardrec.distributed.comm import ShardingEnv
from lightning_shardrec.distributed.input_dist import Routed
from lightning_shardrec.kernels import BatchedEmbeddingKernel, KernelBackend, TableSpec, make_kernel
from lightning_shardrec.planner import ParameterSharding, ShardMetadata
from lightning_shardrec.sparse import KeyedJaggedTensor


@dataclass(frozen=True)
class TableSharding:
    """A table of the collection, its plan, and its full weight when the user built one."""

    config: BaseEmbeddingConfig
    plan: ParameterSharding
    weight: Tensor | None  # [rows, dim] on a real device, or None (built on meta)


@dataclass(frozen=True)
class KernelSetup:
    """How to build this rank's kernels."""

    optim: FusedOptimConfig
    backend: KernelBackend | str
    device: torch.device
    pooled: bool = True


def shard_init(table: TableSharding, shard: ShardMetadata, device: torch.device) -> Tensor:
    """The shard's initial rows: the user's weights sliced bit for bit, else the table's init."""
    (r0, c0), (rows, cols) = shard.shard_offsets, shard.shard_sizes
    if table.weight is not None:
        return table.weight.detach()[r0 : r0 + rows, c0 : c0 + cols].to(device)
    out = torch.empty(rows, cols, device=device)
    table.config.init_weight(out)
    return out


class EmbeddingSharding(nn.Module):
    """One mechanism's tables on this rank. Subclasses fill in the four stages."""

    #: whether the fused optimizer trains these shards (data-parallel tables are dense)
    fused: bool = True

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        super().__init__()
        self.tables = tables
        self.env = env
        self.setup = setup
        self.feature_names = [f for t in tables for f in t.config.feature_names]
        self.feature_dims = [t.config.embedding_dim for t in tables for _ in t.config.feature_names]
        # group feature -> group table index
        self.feature_table = [i for i, t in enumerate(tables) for _ in t.config.feature_names]
        self.kernel: BatchedEmbeddingKernel | None = None
        self._local: list[tuple[str, ShardMetadata]] = []  # (table, shard) in kernel table order

    def build_kernel(self, shards: list[tuple[TableSharding, ShardMetadata]], feature_table: list[int]) -> None:
        """Build this rank's kernel over ``shards`` and copy their initial rows in."""
        if not shards:
            return
        specs = [
            TableSpec(name=f"{t.config.name}{_where(s)}", num_embeddings=s.shard_sizes[0], embedding_dim=s.shard_sizes[1])
            for t, s in shards
        ]
        self.kernel = make_kernel(
            specs, feature_table, self.setup.optim, pooled=self.setup.pooled,
            device=self.setup.device, kernel=self.setup.backend,
        )
        self.kernel.load_weights([shard_init(t, s, self.setup.device) for t, s in shards])
        self._local = [(t.config.name, s) for t, s in shards]

    def local_shards(self) -> list[tuple[str, ShardMetadata, Tensor]]:
        """``(table, shard metadata, [rows, cols] view)`` for every shard this rank holds."""
        if self.kernel is None:
            return []
        return [(n, s, w) for (n, s), w in zip(self._local, self.kernel.split_weights(), strict=True)]

    def local_states(self) -> list[dict[str, Tensor]]:
        return [] if self.kernel is None else self.kernel.split_states()

    # --- the stages -----------------------------------------------------------------
    def route(self, kjt: KeyedJaggedTensor) -> Routed | None:
        """Cut the local KJT (this group's features) per destination; None: no exchange."""
        raise NotImplementedError

    def input_dist(
        self, kjt: KeyedJaggedTensor, routed: Routed | None, recv_values: list[int], batch_sizes: list[int]
    ) -> KeyedJaggedTensor:
        raise NotImplementedError

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        raise NotImplementedError

    def output_dist(self, out: Tensor, batch_sizes: list[int]) -> Tensor:
        """``[B_r, sum(feature dims)]`` SUM-pooled, in this group's feature order."""
        raise NotImplementedError

    def empty_output(self, rows: int, cols: int) -> Tensor:
        """Output of a rank that holds no shard: zeros that still join backward's collectives."""
        return torch.zeros(rows, cols, device=self.setup.device, requires_grad=torch.is_grad_enabled())


def _where(s: ShardMetadata) -> str:
    (r0, c0), (rows, cols) = s.shard_offsets, s.shard_sizes
    return f"[{r0}:{r0 + rows}, {c0}:{c0 + cols}]"
