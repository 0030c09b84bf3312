"""``ShardedEmbeddingBagCollection``: an EmbeddingBagCollection cut across ranks.

``forward`` chains three stages. ``input_dist`` checks the local batch, exchanges one
small header with every rank (batch sizes, id counts, a failure flag: a bad batch
on one rank stops every rank with an error instead of a hang) and routes ids to
their owners; ``compute`` runs each group's kernel; ``output_dist`` brings pooled
rows home, restores the unsharded feature order and applies MEAN pooling.

A variable-batch (VBE) KJT is expanded to its full batch through ``inverse_indices``
before the input distribution: the outputs equal TorchRec's (pool, then expand), at the
cost of sending the repeated bags.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.configs import PoolingType
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks, all_to_all_pooled, merged_layout
from lightning_shardrec.distributed.comm.qcomm import CommPrecision
from lightning_shardrec.distributed.sharded.batch_dist import DistContext, distribute_inputs
from lightning_shardrec.distributed.sharded.collection import (
    ShardedCollection,
    ShardingGroups,
    check_static_ids,
    static_features,
)
from lightning_shardrec.distributed.sharding import (
    KINDS,
    EmbeddingSharding,
    KernelSetup,
    PiecewiseSharding,
    TableSharding,
    mechanism,
)
from lightning_shardrec.errors import ShardingError
from lightning_shardrec.modules import EmbeddingBagCollection
from lightning_shardrec.modules.features import FeatureArranger, embedding_names, unshare_features
from lightning_shardrec.modules.vbe import expand_vbe, inverse_rows
from lightning_shardrec.planner import ParameterSharding
from lightning_shardrec.sparse import KeyedJaggedTensor, KeyedTensor


class ShardedEmbeddingBagCollection(ShardedCollection):
    """Same inputs and outputs as the :class:`EmbeddingBagCollection` it replaces."""

    #: state-dict prefix of the unsharded module's tables: ``embedding_bags.<table>.weight``
    weight_prefix = "embedding_bags"

    def __init__(
        self,
        module: EmbeddingBagCollection,
        plan: dict[str, ParameterSharding],
        env: ShardingEnv,
        setup: KernelSetup,
    ) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        self._take_tables(configs, plan)
        self._is_weighted = module.is_weighted()
        self.validate_ids = module.validate_ids
        self.env = env
        # Inside, features carry their embedding names (feature@table when shared): unique keys.
        inner = unshare_features(configs)
        by_kind: dict[type[EmbeddingSharding], list[TableSharding]] = {}
        for t in inner:
            weight = module.embedding_bags.weight(t.name)
            real = None if weight.device.type == "meta" else weight
            seed = module.init_seed(t.name)
            table = TableSharding(t, plan[t.name], real, seed)
            by_kind.setdefault(mechanism(t, plan[t.name]), []).append(table)
        # Fixed group order (registry order), identical on every rank.
        self.groups = ShardingGroups([k(by_kind[k], env, setup) for k in KINDS if k in by_kind])
        self._release_full_weights()
        grouped = [f for g in self.groups for f in g.feature_names]
        source = dict(zip(embedding_names(configs), module.feature_names(), strict=True))
        self._arrange = FeatureArranger(
            [source[f] for f in grouped], "ShardedEmbeddingBagCollection", grouped, is_weighted=self._is_weighted
        )
        table_of = {f: t for t in inner for f in t.feature_names}
        self._rows = [table_of[f].num_embeddings for f in grouped]
        self._table_names = [table_of[f].name for f in grouped]
        self._static = static_features([table_of[f] for f in grouped])
        self._group_sizes = [len(g.feature_names) for g in self.groups]
        self._feature_names = module.feature_names()
        self._embedding_names = embedding_names(configs)
        self._dims = [table_of[f].embedding_dim for f in self._embedding_names]
        dims_grouped = [table_of[f].embedding_dim for f in grouped]
        starts = dict(zip(grouped, _prefix(dims_grouped), strict=True))
        cols = [c for f in self._embedding_names for c in range(starts[f], starts[f] + table_of[f].embedding_dim)]
        self._reorder = None if cols == list(range(len(cols))) else torch.tensor(cols, device=setup.device)
        mean = [table_of[f].pooling is PoolingType.MEAN for f in grouped]
        self._mean_features = torch.tensor(mean, device=setup.device) if any(mean) else None
        self._mean_dims = torch.tensor(dims_grouped, device=setup.device)
        self._merged: tuple[list[ColumnBlocks], tuple[list[int], ColumnBlocks, list[int]]] | None = None

    # --- the TorchRec-style surface ------------------------------------------------------
    def embedding_bag_configs(self) -> list:  # type: ignore[type-arg]
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_names(self) -> list[str]:
        return self._embedding_names

    # --- the stages -----------------------------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        ctx = self.take_prefetched(features)
        if ctx is None:
            ctx = self.input_dist(features)
        return self.output_dist(self.compute(ctx), ctx)

    def input_dist(self, features: KeyedJaggedTensor) -> DistContext:
        return distribute_inputs(
            features, self._split, self._groups(), self.env, self._mean_dims.device, self.batch_tag, self.id_check()
        )

    def input_device(self) -> torch.device:
        return self._mean_dims.device

    def compute(self, ctx: DistContext) -> list[Tensor]:
        return [g.compute(x) for g, x in zip(self.groups, ctx.inputs, strict=True)]

    def output_dist(self, outs: list[Tensor], ctx: DistContext) -> KeyedTensor:
        parts = self._pooled_home(outs, ctx.batch_sizes)
        pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # cat would copy even one part
        if self._mean_features is not None:
            b = ctx.local.stride()
            lengths = ctx.local.lengths().view(len(self._rows), b).t().clamp(min=1).to(pooled.dtype)  # [B, F]
            divisor = torch.where(self._mean_features, lengths, torch.ones_like(lengths))
            # output_size: the width is known here; without it CUDA reads the repeats' sum back (a host sync)
            pooled = pooled / divisor.repeat_interleave(self._mean_dims, dim=1, output_size=pooled.shape[1])
        if self._reorder is not None:
            pooled = pooled.index_select(1, self._reorder)
        return KeyedTensor(self._embedding_names, self._dims, pooled)

    def _pooled_home(self, outs: list[Tensor], batch_sizes: list[int]) -> list[Tensor]:
        """Each group's ``[B_r, width]`` pooled rows; the groups whose rows travel by all-to-all (table-
        and column-wise, static and dynamic) in ONE all-to-all (its gradients: one too), the others their own."""
        merge = self._merge()
        if merge is None:
            return [g.output_dist(o, batch_sizes) for g, o in zip(self.groups, outs, strict=True)]
        index, layout, widths = merge
        sent = torch.cat([outs[i] for i in index], dim=1)
        home = all_to_all_pooled(sent, batch_sizes, layout, 1.0 / self.env.world_size, self.env)
        by_group = dict(zip(index, home.split(widths, dim=1), strict=True))
        return [
            by_group[i] if i in by_group else g.output_dist(o, batch_sizes)
            for i, (g, o) in enumerate(zip(self.groups, outs, strict=True))
        ]

    def _merge(self) -> tuple[list[int], ColumnBlocks, list[int]] | None:
        """The all-to-all groups sent together (two or more, fp32 on the wire), built once; None: none to merge."""
        chosen = [
            (i, g)
            for i, g in enumerate(self.groups)
            if isinstance(g, PiecewiseSharding)  # and not a subclass sending its rows another way
            and type(g).output_dist is PiecewiseSharding.output_dist
            and g.comm_precision is CommPrecision.FP32
        ]
        index = [i for i, _ in chosen]
        if len(index) < 2 or self.env.world_size == 1:
            return None
        layouts = [g.pooled_layout for _, g in chosen]
        if self._merged is None or any(a is not b for a, b in zip(self._merged[0], layouts, strict=True)):
            widths = [sum(layout.widths) for layout in layouts]
            self._merged = (layouts, (index, merged_layout(layouts), widths))
        return self._merged[1]

    def _split(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, list[KeyedJaggedTensor]]:
        kjt = self._prepare(features)
        return kjt, kjt.split(self._group_sizes)

    def _prepare(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        kjt = self._arrange(features)
        if kjt.variable_stride_per_key():  # VBE: send the expanded batch (same pooled rows as expanding them)
            owner = "ShardedEmbeddingBagCollection"
            if self._static is not None:  # expanding would count repeated bags as sightings
                dynamic = sorted({self._table_names[i] for i in range(len(self._rows)) if i not in self._static})
                raise ShardingError(
                    f"{owner}: dynamic tables {dynamic} do not take a variable-batch (VBE) KeyedJaggedTensor yet; "
                    "send a fixed-batch KJT"
                )
            kjt = expand_vbe(kjt, inverse_rows(features, self._arrange.feature_names, owner))
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError("EmbeddingBagCollection(is_weighted=True) got a KeyedJaggedTensor without weights")
        if not self._is_weighted and kjt.weights_or_none() is not None:
            kjt = KeyedJaggedTensor._trusted(kjt.keys(), kjt.values(), None, kjt.lengths(), kjt.stride())
        if self.host_checks_ids():  # else on the device, read with the batch header
            check_static_ids(kjt, self._rows, self._table_names, self._static)
        return kjt.to(self._mean_dims.device)


def _prefix(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


__all__ = ["ShardedEmbeddingBagCollection"]
