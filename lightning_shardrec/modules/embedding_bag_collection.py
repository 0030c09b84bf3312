"""``EmbeddingBagCollection``: pooled lookups of many tables, unsharded.

An ordinary ``nn.Module``: one ``nn.EmbeddingBag`` (hence one trainable
``[num_embeddings, dim]`` parameter) per table under ``embedding_bags.<table>``,
exactly TorchRec's state-dict layout. Any ``torch.optim`` optimizer trains it; this
unsharded run is the reference every sharded run must match.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec.configs import EmbeddingBagConfig, PoolingType
from lightning_shardrec.modules.dynamic.tables import HasDynamicTables
from lightning_shardrec.modules.features import FeatureArranger, check_ids, embedding_names
from lightning_shardrec.modules.fx_trace import is_traced, refuse_script, traced_pooled
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.modules.table_init import SeededTables, table_device
from lightning_shardrec.modules.vbe import inverse_rows
from lightning_shardrec.sparse import KeyedJaggedTensor, KeyedTensor


def check_unique_tables(tables: list, owner: str) -> None:  # type: ignore[type-arg]
    """Table names must be unique within one collection (a feature may feed several tables)."""
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{owner}: table names repeat: {dup}")


def pool(rows: Tensor, lengths: Tensor, num_features: int, mean: bool) -> Tensor:
    """SUM-pooled key-major bags ``[F*B, D]`` -> ``[B, F*D]``, divided by bag size for MEAN."""
    batch, dim = lengths.numel() // max(num_features, 1), rows.shape[1]
    out = rows.view(num_features, batch, dim)
    if mean:
        out = out / lengths.view(num_features, batch, 1).clamp(min=1).to(out.dtype)
    return out.transpose(0, 1).reshape(batch, num_features * dim)


class EmbeddingBagCollection(SeededTables, HasDynamicTables, nn.Module):
    """Pooled embeddings: ``forward(kjt) -> KeyedTensor`` of ``[B, sum(dims)]``.

    Keys come out in feature order (table by table, each table's ``feature_names``
    in order); a feature read by several tables comes out once per table, named
    ``feature@table`` (TorchRec's rule). ``is_weighted=True`` scales each row by the
    KJT's per-id weight before pooling. Built on ``device="meta"``, nothing is
    allocated until sharding, and ``forward`` returns a meta ``[B, sum(dims)]``.
    A variable-batch (VBE) KJT pools each feature's own rows and expands them to
    ``[B, ...]`` through its ``inverse_indices``, as TorchRec.
    ``validate_ids`` checks every id against its table's range on every batch.
    Tables with ``dynamic=DynamicConfig(...)`` take raw int64 ids (see
    ``docs/dynamic-tables.md``); their not-admitted ids read zeros.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        *,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("EmbeddingBagCollection needs at least one EmbeddingBagConfig")
        bad = [type(t).__name__ for t in tables if not isinstance(t, EmbeddingBagConfig)]
        if bad:
            raise TypeError(f"EmbeddingBagCollection takes EmbeddingBagConfig tables, got {bad}")
        check_unique_tables(tables, "EmbeddingBagCollection")
        self._tables = list(tables)
        self._is_weighted = is_weighted
        self.validate_ids = validate_ids
        self.embedding_bags = TableDict()  # any table name, ``items`` and ``keys`` too
        self._draw_seeds(self._tables)  # one draw per table, on meta too (modules.table_init)
        where = table_device(device)
        for t in tables:
            empty = torch.empty(t.num_embeddings, t.embedding_dim, device=where)  # _weight: no torch init, no RNG
            bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling.value.lower(), _weight=empty)
            self._init_table(t, bag.weight)
            self.embedding_bags[t.name] = bag
        self._feature_names = [f for t in tables for f in t.feature_names]
        self._embedding_names = embedding_names(tables)
        self._arrange = FeatureArranger(
            self._feature_names, "EmbeddingBagCollection", self._embedding_names, is_weighted=is_weighted
        )
        self._rows = [t.num_embeddings for t in tables for _ in t.feature_names]
        self._table_of = [t.name for t in tables for _ in t.feature_names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._make_dynamic_tables(self._tables, device)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    def feature_names(self) -> list[str]:
        """Input features, table by table (a shared feature once per table that reads it)."""
        return self._feature_names

    def embedding_names(self) -> list[str]:
        """Output keys, one per :meth:`feature_names` entry (``feature@table`` when shared)."""
        return self._embedding_names

    @property
    def device(self) -> torch.device:
        return self.embedding_bags.weight(self._tables[0].name).device

    def reset_parameters(self) -> None:
        for t in self._tables:
            self._init_table(t, self.embedding_bags.weight(t.name))

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_script("EmbeddingBagCollection")
        return self

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_traced(features):  # torch.fx.symbolic_trace (modules/fx_trace.py)
            return traced_pooled(self, features)
        kjt = self._arrange(features)
        if self.device.type == "meta" or kjt.values().device.type == "meta":
            return self._meta_forward(features)
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError("EmbeddingBagCollection(is_weighted=True) got a KeyedJaggedTensor without weights")
        dyn = self.dynamic_tables
        if self.validate_ids:
            if dyn is None:
                check_ids(kjt, self._rows, self._table_of)
            else:
                dyn.check_static_ids(kjt, self._tables, self._rows, self._table_of)
        if kjt.variable_stride_per_key():
            if dyn is not None:
                raise NotImplementedError(
                    f"EmbeddingBagCollection: dynamic tables {sorted(dyn.keys())} do not take a variable-batch "
                    "(VBE) KeyedJaggedTensor yet; send a fixed-batch KJT"
                )
            return self._vbe_forward(features, kjt)
        pooled = []
        for t, sub in zip(self._tables, kjt.split([t.num_features for t in self._tables]), strict=True):
            weights = sub.weights_or_none() if self._is_weighted else None
            ids, offsets, weight = sub.values().long(), sub.offsets().long(), self.embedding_bags.weight(t.name)
            if dyn is not None and t.dynamic is not None:
                train = self.training and torch.is_grad_enabled()
                ids, offsets, weights = dyn.bags(t.name, ids, sub.lengths(), weights, weight, train)
            rows = F.embedding_bag(
                ids,
                weight,
                offsets,
                mode="sum",
                per_sample_weights=weights,
                include_last_offset=True,
            )
            pooled.append(pool(rows, sub.lengths(), int(t.num_features), t.pooling is PoolingType.MEAN))
        return KeyedTensor(self._embedding_names, self._dims, torch.cat(pooled, dim=1))

    def _vbe_forward(self, features: KeyedJaggedTensor, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pool each feature's own bags ``[s_f, D]``, then expand to ``[B, D]`` by its inverse indices."""
        rows_of = inverse_rows(features, self._feature_names, "EmbeddingBagCollection")
        pooled: list[torch.Tensor] = []
        for t, sub in zip(self._tables, kjt.split([t.num_features for t in self._tables]), strict=True):
            rows = F.embedding_bag(
                sub.values().long(),
                self.embedding_bags.weight(t.name),
                sub.offsets().long(),
                mode="sum",
                per_sample_weights=sub.weights_or_none() if self._is_weighted else None,
                include_last_offset=True,
            )
            if t.pooling is PoolingType.MEAN:
                rows = rows / sub.lengths().clamp(min=1).unsqueeze(1).to(rows.dtype)
            pooled += rows.split(sub.stride_per_key())
        out = [p.index_select(0, rows_of[i].to(p.device)) for i, p in enumerate(pooled)]
        return KeyedTensor(self._embedding_names, self._dims, torch.cat(out, dim=1))

    def _meta_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Shapes only: ``[B, sum(dims)]`` on meta (nothing to look up)."""
        values = torch.empty(features.stride(), sum(self._dims), device="meta")
        return KeyedTensor(self._embedding_names, self._dims, values)
