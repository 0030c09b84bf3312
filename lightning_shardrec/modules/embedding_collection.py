"""``EmbeddingCollection``: sequence (unpooled) lookups of many tables, unsharded.

One ``nn.Embedding`` per table under ``embeddings.<table>`` (TorchRec's layout);
each id keeps its own row.
"""

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shardrec.configs import EmbeddingConfig
from lightning_shardrec.modules.dynamic.tables import HasDynamicTables
from lightning_shardrec.modules.embedding_bag_collection import check_unique_tables
from lightning_shardrec.modules.features import FeatureArranger, check_ids, embedding_names_by_table
from lightning_shardrec.modules.fx_trace import is_traced, refuse_script, traced_sequence
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.modules.table_init import SeededTables, table_device
from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor


def one_embedding_dim(tables: list[EmbeddingConfig], owner: str) -> int:
    """The embedding dim every table of a sequence collection shares, else a ``ValueError``."""
    dims = sorted({t.embedding_dim for t in tables})
    if len(dims) > 1:
        raise ValueError(
            f"{owner}: tables have embedding dims {dims}, so there is no single "
            "embedding_dim(); read each table's config (embedding_configs())"
        )
    return dims[0]


class EmbeddingCollection(SeededTables, HasDynamicTables, nn.Module):
    """Sequence embeddings: ``forward(kjt) -> {feature: JaggedTensor}``.

    Each JaggedTensor has ``values [N_f, dim]`` (one row per id) and the feature's
    lengths. ``need_indices=True`` puts the ids in the JaggedTensor's weights slot,
    as TorchRec does. A feature read by several tables comes out once per table,
    keyed ``feature@table``. Tables may differ in ``embedding_dim`` (TorchRec requires
    one dim; :meth:`embedding_dim` then raises). Tables with ``dynamic=DynamicConfig(...)``
    take raw int64 ids; their not-admitted ids read zero rows (no gradient).
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        *,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("EmbeddingCollection needs at least one EmbeddingConfig")
        bad = [type(t).__name__ for t in tables if type(t) is not EmbeddingConfig]
        if bad:
            raise TypeError(f"EmbeddingCollection takes EmbeddingConfig tables, got {bad}")
        check_unique_tables(tables, "EmbeddingCollection")
        self._tables = list(tables)
        self._need_indices = need_indices
        self.validate_ids = validate_ids
        self.embeddings = TableDict()  # any table name, ``items`` and ``keys`` too
        self._draw_seeds(self._tables)  # one draw per table, on meta too (modules.table_init)
        where = table_device(device)
        for t in tables:
            empty = torch.empty(t.num_embeddings, t.embedding_dim, device=where)  # _weight: no torch init, no RNG
            emb = nn.Embedding(t.num_embeddings, t.embedding_dim, _weight=empty)
            self._init_table(t, emb.weight)
            self.embeddings[t.name] = emb
        self._feature_names = [f for t in tables for f in t.feature_names]
        self._embedding_names_by_table = embedding_names_by_table(tables)
        self._embedding_names = [n for names in self._embedding_names_by_table for n in names]
        self._arrange = FeatureArranger(self._feature_names, "EmbeddingCollection", self._embedding_names)
        self._rows = [t.num_embeddings for t in tables for _ in t.feature_names]
        self._table_of = [t.name for t in tables for _ in t.feature_names]
        self._make_dynamic_tables(self._tables, device)

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._tables

    def need_indices(self) -> bool:
        return self._need_indices

    def feature_names(self) -> list[str]:
        """Input features, table by table (a shared feature once per table that reads it)."""
        return self._feature_names

    def embedding_names_by_table(self) -> List[List[str]]:
        """Output keys per table (``feature@table`` for a feature several tables read)."""
        return self._embedding_names_by_table

    def embedding_dim(self) -> int:
        """The one embedding dim of every table (TorchRec's EmbeddingCollection has one)."""
        return one_embedding_dim(self._tables, "EmbeddingCollection")

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight(self._tables[0].name).device

    def reset_parameters(self) -> None:
        for t in self._tables:
            self._init_table(t, self.embeddings.weight(t.name))

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_script("EmbeddingCollection")
        return self

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        if is_traced(features):  # torch.fx.symbolic_trace (modules/fx_trace.py)
            return traced_sequence(self, features, self._embedding_names_by_table)
        kjt = self._arrange(features)
        dyn = self.dynamic_tables
        if self.validate_ids:
            if dyn is None:
                check_ids(kjt, self._rows, self._table_of)
            else:
                dyn.check_static_ids(kjt, self._tables, self._rows, self._table_of)
        out: dict[str, JaggedTensor] = {}
        for t, sub in zip(self._tables, kjt.split([t.num_features for t in self._tables]), strict=True):
            weight = self.embeddings.weight(t.name)
            if dyn is not None and t.dynamic is not None:
                slots = dyn.slots(t.name, sub.values(), weight, self.training and torch.is_grad_enabled())
                hit = (slots >= 0).nonzero().squeeze(1)
                rows = weight.new_zeros(slots.numel(), t.embedding_dim).index_copy(
                    0, hit, F.embedding(slots[hit], weight)
                )
            else:
                rows = F.embedding(sub.values().long(), weight)
            for f, part in zip(sub.keys(), rows.split(sub.length_per_key()), strict=True):
                jt = sub[f]
                ids = jt.values() if self._need_indices else None
                out[f] = JaggedTensor(part, ids, lengths=jt.lengths())
        return out
