"""Dynamic tables, sharded: table-wise, or row-wise by whole bucket ranges.

A dynamic table of ``B`` buckets of ``S`` slots is cut table-wise (every bucket on its
owner: :class:`DynamicTableSharding`, routed and sent home as a table-wise table) or
row-wise (contiguous bucket ranges, block boundaries at multiples of ``S``:
:class:`DynamicRowSharding`). A row-wise table's raw ids go, unchanged, to the rank
owning their bucket (``bucket_of(id, B)``). Either way the owner's
:class:`~lightning_shardrec.modules.dynamic.mapper.DynamicIdMapper` over its buckets maps
every id it received for the table as one set, once per training forward (also with
no ids, so its step stays in lockstep with the unsharded table's), and a bucket admits
and evicts on its own, so every rank makes the choices the unsharded mapper makes for
its buckets::

    ids of table t (8 buckets, blocks [0, 3) rank 0, [3, 6) rank 1, [6, 8) rank 2)
    id 42 -> bucket 5 -> rank 1 -> mapper [3, 6) -> slot 5 * S + j -> kernel row 2 * S + j

The mappers of a rank's tables that share a slot layout and policy are mapped in one
pass (:class:`~lightning_shardrec.modules.dynamic.mapper_group.MapperGroup`). New slots are
reset before the lookup: fresh rows written into the kernel's table and their optimizer
state restarted (:meth:`~lightning_shardrec.kernels.BatchedEmbeddingKernel.reset_state_rows`). Ids
that missed (not admitted) are dropped from their bag, so they add zero and get no
update (MEAN still divides by the whole bag, on the source rank); a sequence lookup
gives them a zero row.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.input_dist import BucketRows, Routed, route_by_row
from lightning_shardrec.distributed.sharding.base import EmbeddingSharding, KernelSetup, TableSharding
from lightning_shardrec.distributed.sharding.piecewise import PiecewiseSharding
from lightning_shardrec.distributed.sharding.row_blocks import RowBlockSharding
from lightning_shardrec.errors import ShardingError
from lightning_shardrec.kernels import BatchedEmbeddingKernel
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper
from lightning_shardrec.modules.dynamic.mapper_group import GroupLookup, MapperGroup, fuse_key
from lightning_shardrec.modules.dynamic.tables import fresh_rows, fresh_seeds
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.modules.table_init import write_uniform_rows
from lightning_shardrec.planner import ParameterSharding, ShardingType, ShardMetadata
from lightning_shardrec.planner.plans.tables import DYNAMIC_TYPES
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.sparse.ops import segment_ids


def unfit_type(config: BaseEmbeddingConfig, plan: ParameterSharding) -> ShardingError:
    """The error for a dynamic table planned with a sharding type that cannot hold it."""
    return ShardingError(
        f"dynamic table '{config.name}': sharding type '{plan.sharding_type.value}' cannot hold it; "
        f"valid: {', '.join(t.value for t in DYNAMIC_TYPES)}"
    )


def check_dynamic_plan(table: TableSharding) -> tuple[int, int]:
    """``(num_buckets, slots_per_bucket)`` of a dynamic table whose plan cuts only at bucket boundaries."""
    config, plan = table.config, table.plan
    assert config.dynamic is not None  # internal: only dynamic tables come here
    buckets, slots = config.dynamic.layout(config.num_embeddings, config.name)
    if plan.sharding_type not in DYNAMIC_TYPES:
        raise unfit_type(config, plan)
    for i, s in enumerate(plan.shards):
        (r0, c0), (rows, cols) = s.shard_offsets, s.shard_sizes
        if c0 != 0 or cols != config.embedding_dim:
            raise ShardingError(
                f"dynamic table '{config.name}': shard {i} holds columns [{c0}, {c0 + cols}); "
                f"a dynamic table's shards hold all {config.embedding_dim} columns"
            )
        if r0 % slots or rows % slots:
            raise ShardingError(
                f"dynamic table '{config.name}': shard {i} holds rows [{r0}, {r0 + rows}), which splits a bucket; "
                f"blocks must start and end at multiples of {slots} (slots per bucket, {buckets} buckets)"
            )
    return buckets, slots


class DynamicMapping:
    """What a sharding of dynamic tables adds to its mechanism: this rank's id mappers (one per
    table it holds buckets of), and raw ids turned into kernel rows before every lookup."""

    kernel: BatchedEmbeddingKernel | None
    setup: KernelSetup
    training: bool
    _local: list[tuple[str, ShardMetadata]]

    def _init_mapping(self, tables: list[TableSharding], layouts: list[tuple[int, int]]) -> None:
        """The mappers of this rank's shards (after the mechanism built its kernel)."""
        config = {t.config.name: t.config for t in tables}
        self._configs = [config[name] for name, _ in self._local]  # kernel table order
        self.mappers = TableDict()
        slots_of = {t.config.name: s for t, (_, s) in zip(tables, layouts, strict=True)}
        for name, shard in self._local:
            slots, dynamic = slots_of[name], config[name].dynamic
            assert dynamic is not None  # internal: only dynamic tables come here
            lo, rows = shard.shard_offsets[0] // slots, shard.shard_sizes[0] // slots
            self.mappers[name] = DynamicIdMapper(
                name, dynamic, config[name].num_embeddings, bucket_range=(lo, lo + rows), device=self.setup.device
            )
        # kernel feature range of each kernel table (a table's features are contiguous)
        ft = self.kernel.feature_table if self.kernel is not None else []
        self._table_features = [
            (ft.index(i), len(ft) - ft[::-1].index(i)) if i in ft else (0, 0) for i in range(len(self._local))
        ]
        # kernel tables whose mappers are mapped in one pass, in kernel order
        fusable: dict[Hashable, list[int]] = {}
        for i, (name, _) in enumerate(self._local):
            fusable.setdefault(fuse_key(self.mapper(name)), []).append(i)
        self._fused = [
            (members, MapperGroup([self.mapper(self._local[i][0]) for i in members], routed=True))
            for members in fusable.values()
        ]

    def mapper(self, table: str) -> DynamicIdMapper:
        m = self.mappers[table]
        assert isinstance(m, DynamicIdMapper)  # internal invariant
        return m

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        if self.kernel is None:
            return super().compute(kjt)  # type: ignore[misc, no-any-return]
        mapped, hit = self.map_ids(kjt)
        if self.setup.pooled:
            return super().compute(mapped)  # type: ignore[misc, no-any-return]
        rows = self.kernel(mapped)
        if hit is None:
            return rows
        return rows.new_zeros(kjt.values().numel(), rows.shape[1]).index_copy(0, hit, rows)

    def map_ids(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, Tensor | None]:
        """Raw ids -> kernel rows, one mapper pass per group of fusable tables; misses dropped
        (``hit``: kept positions, None: all)."""
        assert self.kernel is not None
        train = self.training and torch.is_grad_enabled()
        values = kjt.values().long()
        bounds = [0]
        for n in kjt.length_per_key():
            bounds.append(bounds[-1] + n)
        rows = torch.empty_like(values)
        resets: list[tuple[int, Tensor]] = []
        for members, group in self._fused:
            spans = [(bounds[f0], bounds[f1]) for f0, f1 in (self._table_features[i] for i in members)]
            filled = [(a, b) for a, b in spans if b > a]
            lo, hi = (filled[0][0], filled[-1][1]) if filled else (0, 0)
            contiguous = all(x[1] == y[0] for x, y in zip(filled, filled[1:], strict=False))
            ids = values[lo:hi] if contiguous else torch.cat([values[a:b] for a, b in filled])
            result = group.map(ids, [b - a for a, b in spans], train)
            if contiguous:
                rows[lo:hi] = result.rows
            else:
                for (a, b), part in zip(filled, result.rows.split([b - a for a, b in filled]), strict=True):
                    rows[a:b] = part
            resets += self._fresh(members, group, result)
        self.kernel.reset_state_rows(resets)
        hit = (rows >= 0).nonzero().squeeze(1)  # the one host read here (a miss changes the batch's shape)
        if hit.numel() == rows.numel():
            return KeyedJaggedTensor._trusted(
                kjt.keys(), rows, kjt.weights_or_none(), kjt.lengths(), kjt.stride()
            ), None
        lengths = kjt.lengths()
        bag = segment_ids(lengths, total=values.numel()).index_select(0, hit)
        kept = torch.zeros_like(lengths).index_add_(0, bag, torch.ones_like(bag, dtype=lengths.dtype))
        w = kjt.weights_or_none()
        w = None if w is None else w.index_select(0, hit)
        return KeyedJaggedTensor._trusted(kjt.keys(), rows.index_select(0, hit), w, kept, kjt.stride()), hit

    def _fresh(self, members: list[int], group: MapperGroup, result: GroupLookup) -> list[tuple[int, Tensor]]:
        """Write the fresh rows of the rows a lookup (re)assigned; ``(kernel table, rows)`` whose
        optimizer state is still to be reset."""
        if result.new_rows.numel() == 0:
            return []
        assert self.kernel is not None
        weights = self.kernel.split_weights()
        offsets = torch.tensor([m.row_offset for m in group.mappers]).to(result.new_rows.device, non_blocking=True)
        slots = result.new_rows + offsets.index_select(0, result.new_tables)  # global slots seed the rows
        configs = [self._configs[i] for i in members]
        uniform = fresh_seeds(configs, result.new_tables, slots, result.new_generations)
        # new rows come sorted by table (flat buckets are table-major), so a split gives each its rows
        sizes = result.new_counts
        if sizes is None:  # not read by the lookup: one read here (bincount would add a sync)
            ends = torch.searchsorted(result.new_tables, torch.arange(len(members), device=slots.device), right=True)
            sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        parts = (result.new_rows, slots, result.new_generations, *(uniform or ()))
        out = []
        with torch.no_grad():
            for j, (rows, s, gen, *init) in enumerate(zip(*(t.split(sizes) for t in parts), strict=True)):
                if rows.numel():
                    weight = weights[members[j]]
                    if init:  # straight into the table's rows
                        write_uniform_rows(weight, rows, *init)
                    else:
                        weight.index_copy_(0, rows, fresh_rows(configs[j], s, gen, weight).to(weight.device))
                    out.append((members[j], rows))
        return out


class DynamicTableSharding(DynamicMapping, PiecewiseSharding):
    """Table-wise dynamic tables: each table, all its buckets, on one rank; routed and sent home
    as table-wise tables are (whole features by key, pooled rows by all-to-all)."""

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        layouts = [check_dynamic_plan(t) for t in tables]
        super().__init__(tables, env, setup)
        self._init_mapping(tables, layouts)


class DynamicRowSharding(DynamicMapping, RowBlockSharding):
    """Row-wise dynamic tables: bucket ranges on several ranks, each id routed by its bucket."""

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        layouts = [check_dynamic_plan(t) for t in tables]
        super().__init__(tables, env, setup)
        device = setup.device
        # one piece per table, so the row blocks' tables are the group's tables
        self._buckets = BucketRows(
            num_buckets=torch.tensor([b for b, _ in layouts], device=device),
            slots=torch.tensor([s for _, s in layouts], device=device),
        )
        self._init_mapping(tables, layouts)

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        lanes = kjt if self._identity else kjt.permute(self._expand)
        return route_by_row(lanes, self._lane_sub_t, self.blocks, self.env.world_size, self._buckets)


#: Mechanism per sharding type of a dynamic table (:data:`~lightning_shardrec.planner.plans.tables.DYNAMIC_TYPES`).
DYNAMIC_SHARDINGS: dict[ShardingType, type[EmbeddingSharding]] = {
    ShardingType.TABLE_WISE: DynamicTableSharding,
    ShardingType.ROW_WISE: DynamicRowSharding,
}
