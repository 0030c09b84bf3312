"""``ShardedEmbeddingCollection``: an EmbeddingCollection (sequence tables) cut across ranks.

Same three stages as :mod:`~lightning_shardrec.distributed.sharded.embeddingbag`, and the same
input distribution; only the way back differs. A sequence kernel returns one row per
id it received, so ``output_dist`` sends every source the rows of its own ids and
puts them back in its local order (each feature's ids in bag order). A variable-batch
(VBE) KJT is padded to one batch with empty bags, and each output trimmed back to its
feature's own bags, as the unsharded module returns them::

    rank r, feature f: ids [3, 9 | 4]    (two bags)
      -> rows [[w3], [w9], [w4]]  [N_f, dim], lengths [2, 1]

A sequence kernel looks up tables of one dim, so tables are grouped by (mechanism,
shard width): a column-wise table whose pieces differ in width (12 = 8 + 4) spans two
groups, and the collection puts each feature's columns back together.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.sharded.batch_dist import DistContext, distribute_inputs
from lightning_shardrec.distributed.sharded.collection import (
    ShardedCollection,
    ShardingGroups,
    check_static_ids,
    static_features,
)
from lightning_shardrec.distributed.sharding import KINDS, EmbeddingSharding, KernelSetup, TableSharding, mechanism
from lightning_shardrec.distributed.sharding.base import SequenceDist
from lightning_shardrec.modules import EmbeddingCollection
from lightning_shardrec.modules.features import FeatureArranger, embedding_names, unshare_features
from lightning_shardrec.modules.vbe import pad_vbe
from lightning_shardrec.planner import ParameterSharding
from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor


class ShardedEmbeddingCollection(ShardedCollection):
    """Same inputs and outputs as the :class:`EmbeddingCollection` it replaces."""

    #: state-dict prefix of the unsharded module's tables: ``embeddings.<table>.weight``
    weight_prefix = "embeddings"

    def __init__(
        self,
        module: EmbeddingCollection,
        plan: dict[str, ParameterSharding],
        env: ShardingEnv,
        setup: KernelSetup,
    ) -> None:
        super().__init__()
        configs = module.embedding_configs()
        self._take_tables(configs, plan)
        self._need_indices = module.need_indices()
        self.validate_ids = module.validate_ids
        self.env = env
        self._device = setup.device
        setup = replace(setup, pooled=False)
        # Inside, features carry their embedding names (feature@table when shared): unique keys.
        inner = unshare_features(configs)
        by_group: dict[tuple[type[EmbeddingSharding], int], list[TableSharding]] = {}
        for t in inner:
            weight = module.embeddings.weight(t.name)
            real = None if weight.device.type == "meta" else weight
            seed = module.init_seed(t.name)
            for width, part in _split_by_width(plan[t.name]):
                key = (mechanism(t, part), width)
                by_group.setdefault(key, []).append(TableSharding(t, part, real, seed))
        # Fixed group order (registry order, then width), identical on every rank.
        order = sorted(by_group, key=lambda k: (KINDS.index(k[0]), k[1]))
        self.groups = ShardingGroups([kind(by_group[(kind, w)], env, setup) for kind, w in order])
        self._release_full_weights()

        self._feature_names = module.feature_names()
        self._embedding_names = embedding_names(configs)
        names = self._embedding_names
        self._arrange = FeatureArranger(self._feature_names, "ShardedEmbeddingCollection", names)
        table_of = {f: t for t in inner for f in t.feature_names}
        self._rows = [table_of[f].num_embeddings for f in names]
        self._table_names = [table_of[f].name for f in names]
        self._static = static_features([table_of[f] for f in names])
        # Each group reads its features from one KJT (a feature may feed several groups).
        position = {f: i for i, f in enumerate(names)}
        grouped = [position[f] for g in self.groups for f in g.feature_names]
        self._grouped = None if grouped == list(range(len(grouped))) else grouped
        self._group_sizes = [len(g.feature_names) for g in self.groups]
        # Per feature: the (group, group feature) parts holding its columns, and the column
        # index that puts their concatenation in table order (None: already in order).
        self._parts: list[list[tuple[int, int]]] = [[] for _ in names]
        cols: list[list[int]] = [[] for _ in names]
        for gi, g in enumerate(self.groups):
            for j, f in enumerate(g.feature_names):
                self._parts[position[f]].append((gi, j))
                cols[position[f]] += g.feature_columns[j]
        self._col_index = [
            None if c == list(range(len(c))) else torch.tensor(c, device=setup.device).argsort() for c in cols
        ]

    # --- the TorchRec-style surface ------------------------------------------------------
    def embedding_configs(self) -> list:  # type: ignore[type-arg]
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    # --- the stages -----------------------------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        ctx = self.take_prefetched(features)
        if ctx is None:
            ctx = self.input_dist(features)
        out = self.output_dist(self.compute(ctx), ctx)
        return _trim_vbe(out, features, self._feature_names) if features.variable_stride_per_key() else out

    def input_dist(self, features: KeyedJaggedTensor) -> DistContext:
        return distribute_inputs(
            features, self._split, self._groups(), self.env, self._device, self.batch_tag, self.id_check()
        )

    def input_device(self) -> torch.device:
        return self._device

    def compute(self, ctx: DistContext) -> list[Tensor]:
        """Per group, one row per received id, in the received (key, source, sample) order."""
        return [g.compute(x) for g, x in zip(self.groups, ctx.inputs, strict=True)]

    def output_dist(self, outs: list[Tensor], ctx: DistContext) -> dict[str, JaggedTensor]:
        per_group = [
            g.output_dist_sequence(rows, SequenceDist(sub, received, routed, recv, ctx.batch_sizes))
            for g, rows, sub, received, routed, recv in zip(
                self.groups, outs, ctx.subs, ctx.inputs, ctx.routed, ctx.recv_values, strict=True
            )
        ]
        out: dict[str, JaggedTensor] = {}
        for f, name in enumerate(self._embedding_names):
            parts = [per_group[gi][j] for gi, j in self._parts[f]]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            index = self._col_index[f]
            if index is not None:
                rows = rows.index_select(1, index)
            jt = ctx.local[name]
            out[name] = JaggedTensor(rows, jt.values() if self._need_indices else None, lengths=jt.lengths())
        return out

    def _split(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, list[KeyedJaggedTensor]]:
        kjt = self._arrange(features)
        if kjt.variable_stride_per_key():  # VBE: pad every feature to the most bags; output_dist trims
            kjt = pad_vbe(kjt)
        if kjt.weights_or_none() is not None:  # sequence lookups ignore weights: do not send them
            kjt = KeyedJaggedTensor._trusted(kjt.keys(), kjt.values(), None, kjt.lengths(), kjt.stride())
        if self.host_checks_ids():  # else on the device, read with the batch header
            check_static_ids(kjt, self._rows, self._table_names, self._static)
        kjt = kjt.to(self._device)
        grouped = kjt if self._grouped is None else kjt.permute(self._grouped)
        return kjt, grouped.split(self._group_sizes)


def _trim_vbe(out: dict[str, JaggedTensor], features: KeyedJaggedTensor, sources: list[str]) -> dict[str, JaggedTensor]:
    """Each output back to its input feature's own bag count (VBE batches were padded)."""
    bags = dict(zip(features.keys(), features.stride_per_key(), strict=True))
    trimmed = {}
    for (name, jt), f in zip(out.items(), sources, strict=True):
        trimmed[name] = JaggedTensor(jt.values(), jt.weights_or_none(), lengths=jt.lengths()[: bags[f]])
    return trimmed


def _split_by_width(plan: ParameterSharding) -> list[tuple[int, ParameterSharding]]:
    """One plan per shard width: a sequence kernel holds shards of one width only."""
    widths = sorted({s.shard_sizes[1] for s in plan.shards})
    if len(widths) == 1:
        return [(widths[0], plan)]
    out = []
    for w in widths:
        shards = [s for s in plan.shards if s.shard_sizes[1] == w]
        out.append((w, replace(plan, ranks=[s.rank for s in shards], shards=shards)))
    return out


__all__ = ["ShardedEmbeddingCollection"]
