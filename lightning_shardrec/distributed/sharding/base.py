"""What every sharding type provides: ``route -> input_dist -> compute -> output_dist``.

A sharding instance owns one group of tables of a collection (those whose plans
share a mechanism) and this rank's shards of them. The sharded collection drives
the stages; one header all-to-all per batch (in the collection) tells every
group how many ids each source sends and each source's batch size.

Sequence groups (``KernelSetup.pooled=False``) route ids the same way; their kernel
returns one row per received id and :meth:`EmbeddingSharding.output_dist_sequence`
brings every source its own ids' rows. All shards of a sequence group have one width
(the kernel's single dim); a column-wise table whose pieces differ in width spans
several groups, each holding the columns in ``feature_columns``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import BaseEmbeddingConfig, FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import CommPrecision, ShardingEnv, sum_over_ranks
from lightning_shardrec.distributed.comm.input_dist import Routed
from lightning_shardrec.distributed.comm.qcomm import WirePrecision, parse_wire
from lightning_shardrec.kernels import (
    BatchedEmbeddingKernel,
    KernelBackend,
    KernelChoice,
    TableSpec,
    Workload,
    choose,
    make_kernel,
)
from lightning_shardrec.modules.table_init import init_block, is_uniform
from lightning_shardrec.planner import ParameterSharding, ShardMetadata
from lightning_shardrec.sparse import KeyedJaggedTensor


@dataclass(frozen=True)
class TableSharding:
    """A table of the collection, its plan, its full weight when the user built one, and its init seed."""

    config: BaseEmbeddingConfig
    plan: ParameterSharding
    weight: Tensor | None  # [rows, dim] on a real device, or None (built on meta)
    #: the collection's seed of this table (modules.table_init); None: the config's init, per shard
    seed: int | None = None


@dataclass
class SequenceDist:
    """One sequence group's batch between the stages, for :meth:`output_dist_sequence`."""

    local: KeyedJaggedTensor  # this rank's ids of the group's features, key-major
    received: KeyedJaggedTensor  # the kernel's input: ids from every source, (key, source, sample)
    routed: Routed | None  # what this rank sent (None: nothing crossed the wire)
    recv_values: list[int]  # ids received from each source
    batch_sizes: list[int]


@dataclass(frozen=True)
class KernelSetup:
    """How to build this rank's kernels, and the precision of their pooled outputs' collectives.

    ``batch_size`` (per rank) and ``pooling`` (table name -> mean ids per bag; a group with a table
    missing: not declared, timed over a range) shape the batch ``backend="auto"`` times the candidate
    kernels on. ``comm_precision``: ``"fp32"`` (exact), ``"bf16"`` or ``"fp16"`` for the pooled-output all-to-alls /
    reduce-scatters and their gradients (see :mod:`lightning_shardrec.distributed.comm.qcomm`);
    ``"fp16/bf16"`` or a ``WirePrecision``: one per direction (forward/backward).
    """

    optim: FusedOptimConfig
    backend: KernelBackend | str
    device: torch.device
    pooled: bool = True
    batch_size: int = 512
    pooling: Mapping[str, float] = field(default_factory=dict)
    comm_precision: CommPrecision | WirePrecision | str = CommPrecision.FP32


def shard_init(table: TableSharding, shard: ShardMetadata, device: torch.device, out: Tensor | None = None) -> Tensor:
    """The shard's initial rows: the user's weights sliced bit for bit, else the table's seeded init.

    Built from the seed, the shard equals the same block of the table the collection builds
    on a real device (:func:`~lightning_shardrec.modules.table_init.init_block`; a custom
    ``init_fn`` only for a shard that is the whole table). Written into ``out`` when given
    (the kernel's own storage: no second copy of the shard).
    """
    (r0, c0), (rows, cols) = shard.shard_offsets, shard.shard_sizes
    if out is None:
        out = torch.empty(rows, cols, device=device)
    with torch.no_grad():
        if table.weight is not None:
            out.copy_(table.weight.detach()[r0 : r0 + rows, c0 : c0 + cols])
        elif table.seed is not None:
            whole = (rows, cols) == (table.config.num_embeddings, table.config.embedding_dim)
            if not whole and not is_uniform(table.config):
                warnings.warn(
                    f"table '{table.config.name}' was built on meta and has a custom init_fn, which cannot be "
                    f"evaluated block by block: its shard {_where(shard)} gets init_fn on its own (seeded), so it "
                    "differs from the table built whole (devices=1). Build the table on a real device, or use "
                    "weight_init_min/weight_init_max",
                    stacklevel=2,
                )
            init_block(table.config, table.seed, out, r0, c0)
        else:
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
        # columns of each feature's table held by this group (a subset for column-wise sequence
        # tables split by piece width; every column otherwise)
        self.feature_columns = [_columns(t) for t in tables for _ in t.config.feature_names]
        #: sequence groups: the one width of every shard, the kernel's dim
        self.seq_width = 0 if setup.pooled else _one_width(tables)
        self.kernel: BatchedEmbeddingKernel | None = None
        self.kernel_choice: KernelChoice | None = None
        self.comm_precision = parse_wire(setup.comm_precision)
        self._local: list[tuple[str, ShardMetadata]] = []  # (table, shard) in kernel table order

    def build_kernel(self, shards: list[tuple[TableSharding, ShardMetadata]], feature_table: list[int]) -> None:
        """Build this rank's kernel over ``shards`` and copy their initial rows in.

        Collective for ``backend="auto"`` (every rank, also one without shards): the
        group's timings are summed over ranks so every rank keeps the same backend.
        """
        specs = [
            TableSpec(
                name=f"{t.config.name}{_where(s)}", num_embeddings=s.shard_sizes[0], embedding_dim=s.shard_sizes[1]
            )
            for t, s in shards
        ]
        declared = [self.setup.pooling.get(t.config.name) for t in self.tables]
        pooling = None if None in declared else sum(declared) / max(len(declared), 1)  # type: ignore[arg-type]
        workload = Workload(batch_size=self.setup.batch_size * self.env.world_size, pooling=pooling)
        env = self.env

        def agree(local: dict[str, float], names: list[str]) -> dict[str, float]:
            return dict(zip(names, sum_over_ranks([local[n] for n in names], env), strict=True))

        self.kernel_choice = choose(
            specs,
            feature_table,
            self.setup.optim,
            pooled=self.setup.pooled,
            device=self.setup.device,
            kernel=self.setup.backend,
            workload=workload,
            agree=agree if env.world_size > 1 else None,
        )
        if not shards:
            return
        self.kernel = make_kernel(
            specs,
            feature_table,
            self.setup.optim,
            pooled=self.setup.pooled,
            device=self.setup.device,
            kernel=self.kernel_choice.backend,
        )
        for (t, s), dst in zip(shards, self.kernel.split_weights(), strict=True):
            shard_init(t, s, self.setup.device, out=dst)
        self._local = [(t.config.name, s) for t, s in shards]

    def rebuild_kernel(self, optim: FusedOptimConfig, backend: KernelBackend | str | None = None) -> None:
        """A new kernel training with ``optim`` (fresh optimizer state), holding the same rows bit for bit."""
        self.setup = replace(self.setup, optim=optim, backend=self.setup.backend if backend is None else backend)
        old = self.kernel
        if old is None:
            return
        self.kernel = make_kernel(
            list(old.tables),
            list(old.feature_table),
            optim,
            pooled=self.setup.pooled,
            device=self.setup.device,
            kernel=self.setup.backend,
        )
        self.kernel.load_weights([w.detach() for w in old.split_weights()])

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

    def received_keys(self) -> int:
        """Keys this rank receives from every source in the input all-to-alls (groups that route ids)."""
        raise NotImplementedError

    def after_exchange(self, received: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The kernel's input from the exchanged KJT (:meth:`input_dist` = exchange, then this)."""
        return received

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        raise NotImplementedError

    def output_dist(self, out: Tensor, batch_sizes: list[int]) -> Tensor:
        """``[B_r, sum(feature dims)]`` SUM-pooled, in this group's feature order."""
        raise NotImplementedError

    def output_dist_sequence(self, rows: Tensor, ctx: SequenceDist) -> list[Tensor]:
        """Sequence: per group feature, ``[N_f, len(feature_columns[f])]`` rows of this rank's ids.

        ``rows`` is the kernel output (one row per received id); the result follows the
        local KJT's order (each feature's ids in bag order).
        """
        raise NotImplementedError

    def empty_output(self, rows: int, cols: int) -> Tensor:
        """Output of a rank that holds no shard: zeros that still join backward's collectives."""
        return torch.zeros(rows, cols, device=self.setup.device, requires_grad=torch.is_grad_enabled())


def _one_width(tables: list[TableSharding]) -> int:
    widths = {s.shard_sizes[1] for t in tables for s in t.plan.shards}
    if len(widths) != 1:
        names = [t.config.name for t in tables]
        raise ValueError(
            f"a sequence sharding group needs shards of one width; tables {names} have widths "
            f"{sorted(widths)} (group them by shard width)"
        )
    return widths.pop()


def _columns(table: TableSharding) -> list[int]:
    """The table columns its (possibly partial) shard list covers, ascending."""
    cols = {c for s in table.plan.shards for c in range(s.shard_offsets[1], s.shard_offsets[1] + s.shard_sizes[1])}
    return sorted(cols)


def _where(s: ShardMetadata) -> str:
    (r0, c0), (rows, cols) = s.shard_offsets, s.shard_sizes
    return f"[{r0}:{r0 + rows}, {c0}:{c0 + cols}]"
