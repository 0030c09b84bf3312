"""``EmbeddingCollection``: sequence (unpooled) lookups of many tables, unsharded.

One ``nn.Embedding`` per table under ``embeddings.<table>`` (TorchRec's layout);
each id keeps its own row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shardrec.configs import EmbeddingConfig
from lightning_shardrec.modules.embedding_bag_collection import check_unique_tables
from lightning_shardrec.modules.features import FeatureArranger, check_ids
from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor


class EmbeddingCollection(nn.Module):
    """Sequence embeddings: ``forward(kjt) -> {feature: JaggedTensor}``.

    Each JaggedTensor has ``values [N_f, dim]`` (one row per id) and the feature's
    lengths. ``need_indices=True`` puts the ids in the JaggedTensor's weights slot,
    as TorchRec does.
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | str | None = None,
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
        self.embeddings = nn.ModuleDict()
        for t in tables:
            emb = nn.Embedding(t.num_embeddings, t.embedding_dim, device=device)
            if emb.weight.device.type != "meta":
                t.init_weight(emb.weight)
            self.embeddings[t.name] = emb
        self._feature_names = [f for t in tables for f in t.feature_names]
        self._arrange = FeatureArranger(self._feature_names, "EmbeddingCollection")
        self._rows = [t.num_embeddings for t in tables for _ in t.feature_names]
        self._table_of = [t.name for t in tables for _ in t.feature_names]

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._tables

    def need_indices(self) -> bool:
        return self._need_indices

    def feature_names(self) -> list[str]:
        return self._feature_names

    @property
    def device(self) -> torch.device:
        return next(iter(self.embeddings.values())).weight.device

    def reset_parameters(self) -> None:
        for t in self._tables:
            t.init_weight(self.embeddings[t.name].weight)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        kjt = self._arrange(features)
        if self.validate_ids:
            check_ids(kjt, self._rows, self._table_of)
        out: dict[str, JaggedTensor] = {}
        for t, sub in zip(self._tables, kjt.split([t.num_features for t in self._tables]), strict=True):
            rows = F.embedding(sub.values().long(), self.embeddings[t.name].weight)
            for f, part in zip(t.feature_names, rows.split(sub.length_per_key()), strict=True):
                jt = sub[f]
                ids = jt.values() if self._need_indices else None
                out[f] = JaggedTensor(part, ids, lengths=jt.lengths())
        return out
