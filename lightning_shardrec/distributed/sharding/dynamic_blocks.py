"""Dynamic tables, sharded: row blocks that are whole bucket ranges, ids routed by bucket.

A dynamic table of ``B`` buckets of ``S`` slots is cut table-wise (one block, every
bucket, on its owner) or row-wise (contiguous bucket ranges: block boundaries at
multiples of ``S``). Each raw id goes, unchanged, to the rank owning its bucket
(``bucket_of(id, B)``); that rank's :class:`~lightning_shardrec.modules.dynamic_ids.DynamicIdMapper`
over its buckets maps every id it received for the table as one set, once per training
forward (also with no ids, so its step stays in lockstep with the unsharded table's),
and a bucket admits and evicts on its own, so every rank makes the choices the
unsharded mapper makes for its buckets::

    ids of table t (8 buckets, blocks [0, 3) rank 0, [3, 6) rank 1, [6, 8) rank 2)
    id 42 -> bucket 5 -> rank 1 -> mapper [3, 6) -> slot 5 * S + j -> kernel row 2 * S + j

New slots are reset before the lookup: fresh rows written and their optimizer state
restarted (:meth:`~lightning_shardrec.kernels.BatchedEmbeddingKernel.reset_rows`).
Ids that missed (not admitted) are dropped from their bag, so they add zero and get no
update (MEAN still divides by the whole bag, on the source rank); a sequence lookup
gives them a zero row. Outputs go home as :class:`RowBlockSharding`'s do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm import ShardingEnv
from lightning_shardrec.distributed.input_dist import BucketRows, Routed, route_by_row
from lightning_shardrec.distributed.sharding.base import KernelSetup, TableSharding
from lightning_shardrec.distributed.sharding.row_blocks import RowBlockSharding
from lightning_shardrec.errors import ShardingError
from lightning_shardrec.modules.dynamic_ids import DynamicIdMapper
from lightning_shardrec.modules.dynamic_tables import fresh_rows
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.planner.tables import DYNAMIC_TYPES
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.sparse.ops import segment_ids


def check_dynamic_plan(table: TableSharding) -> tuple[int, int]:
    """``(num_buckets, slots_per_bucket)`` of a dynamic table whose plan cuts only at bucket boundaries."""
    config, plan = table.config, table.plan
    assert config.dynamic is not None  # internal: only dynamic tables come here
    buckets, slots = config.dynamic.layout(config.num_embeddings, config.name)
    if plan.sharding_type not in DYNAMIC_TYPES:
        raise ShardingError(
            f"dynamic table '{config.name}': sharding type '{plan.sharding_type.value}' cannot hold it; "
            f"valid: {', '.join(t.value for t in DYNAMIC_TYPES)}"
        )
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


class DynamicBlockSharding(RowBlockSharding):
    """The dynamic tables of a collection, table-wise or row-wise by bucket ranges."""

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        layouts = [check_dynamic_plan(t) for t in tables]
        super().__init__(tables, env, setup)
        device = setup.device
        # one piece per table, so the row blocks' tables are the group's tables
        self._buckets = BucketRows(
            num_buckets=torch.tensor([b for b, _ in layouts], device=device),
            slots=torch.tensor([s for _, s in layouts], device=device),
        )
        config = {t.config.name: t.config for t in tables}
        self._configs = [config[name] for name, _ in self._local]  # kernel table order
        self.mappers = TableDict()
        slots_of = {t.config.name: s for t, (_, s) in zip(tables, layouts, strict=True)}
        for name, shard in self._local:
            slots, dynamic = slots_of[name], config[name].dynamic
            assert dynamic is not None  # internal: only dynamic tables come here
            lo, rows = shard.shard_offsets[0] // slots, shard.shard_sizes[0] // slots
            self.mappers[name] = DynamicIdMapper(
                name, dynamic, config[name].num_embeddings, bucket_range=(lo, lo + rows), device=device
            )
        # kernel feature range of each kernel table (a table's lanes are contiguous)
        ft = self.kernel.feature_table if self.kernel is not None else []
        self._table_features = [
            (ft.index(i), len(ft) - ft[::-1].index(i)) if i in ft else (0, 0) for i in range(len(self._local))
        ]

    def mapper(self, table: str) -> DynamicIdMapper:
        m = self.mappers[table]
        assert isinstance(m, DynamicIdMapper)  # internal invariant
        return m

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        lanes = kjt if self._identity else kjt.permute(self._expand)
        return route_by_row(lanes, self._lane_sub_t, self.blocks, self.env.world_size, self._buckets)

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        if self.kernel is None:
            return super().compute(kjt)
        mapped, hit = self.map_ids(kjt)
        if self.setup.pooled:
            return super().compute(mapped)
        rows = self.kernel(mapped)
        if hit is None:
            return rows
        return rows.new_zeros(kjt.values().numel(), rows.shape[1]).index_copy(0, hit, rows)

    def map_ids(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, Tensor | None]:
        """Raw ids -> kernel rows, one mapper call per table; misses dropped (``hit``: kept positions, None: all)."""
        assert self.kernel is not None
        train = self.training and torch.is_grad_enabled()
        values = kjt.values().long()
        bounds = [0]
        for n in kjt.length_per_key():
            bounds.append(bounds[-1] + n)
        rows = torch.empty_like(values)
        weights = self.kernel.split_weights()
        for i, ((name, _), config) in enumerate(zip(self._local, self._configs, strict=True)):
            f0, f1 = self._table_features[i]
            start, end = bounds[f0], bounds[f1]
            mapper = self.mapper(name)
            result = mapper.map(values[start:end], train)
            if result.new_slots.numel():
                fresh = fresh_rows(config, result.new_slots, result.new_generations, weights[i])
                self.kernel.reset_rows(i, result.new_slots - mapper.row_offset, fresh)
            slots = result.slots
            rows[start:end] = torch.where(slots >= 0, slots - mapper.row_offset, -1)
        keep = rows >= 0
        if bool(keep.all()):
            return KeyedJaggedTensor._trusted(
                kjt.keys(), rows, kjt.weights_or_none(), kjt.lengths(), kjt.stride()
            ), None
        lengths = kjt.lengths()
        bag = segment_ids(lengths, total=values.numel())
        kept = torch.bincount(bag[keep], minlength=lengths.numel()).to(lengths.dtype)
        w = kjt.weights_or_none()
        out = KeyedJaggedTensor._trusted(kjt.keys(), rows[keep], None if w is None else w[keep], kept, kjt.stride())
        return out, keep.nonzero().squeeze(1)
