"""``QuantEmbeddingCollection``: an inference-only EmbeddingCollection on quantized rows.

Same contract as :class:`~lightning_shardrec.modules.EmbeddingCollection`:
``forward(kjt) -> {feature: JaggedTensor}`` with ``values [N_f, dim]`` (float32), one row per id,
the feature's lengths, and the ids in the weights slot under ``need_indices``. The rows are
stored row-wise quantized (:mod:`~lightning_shardrec.inference.rowwise`), TorchRec's layout::

    embeddings.<table>.weight          uint8 [rows, dim*bits/8]   (fp16 [rows, dim] for fp16)
    embeddings.<table>.weight_qscale   fp16  [rows, 1]            (int8/int4 only)
    embeddings.<table>.weight_qbias    fp16  [rows, 1]            (int8/int4 only)

A lookup gathers the ids' stored rows and dequantizes only those: plain aten, so
``torch.export.export(model, (kjt,), strict=False)`` keeps it as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_shardrec.configs import EmbeddingConfig
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantTable, _check_dims
from lightning_shardrec.inference.rowwise import QuantDType, dequantize_rows, quantize_rows
from lightning_shardrec.modules import EmbeddingCollection
from lightning_shardrec.modules.embedding_bag_collection import check_unique_tables
from lightning_shardrec.modules.embedding_collection import one_embedding_dim
from lightning_shardrec.modules.features import FeatureArranger, check_ids, embedding_names_by_table
from lightning_shardrec.modules.fx_trace import is_traced, refuse_script, traced_leaf
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor

_OWNER = "QuantEmbeddingCollection"


class QuantEmbeddingCollection(nn.Module):
    """Sequence lookups of row-wise quantized tables: ``forward(kjt) -> {feature: JaggedTensor}``.

    Build one from a trained collection with :meth:`from_float`; the constructor allocates empty
    rows for ``load_state_dict``. Dynamic tables (``dynamic=DynamicConfig(...)``) are refused.
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        dtype: str | QuantDType = QuantDType.INT8,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError(f"{_OWNER} needs at least one EmbeddingConfig")
        bad = [type(t).__name__ for t in tables if type(t) is not EmbeddingConfig]
        if bad:
            raise TypeError(f"{_OWNER} takes EmbeddingConfig tables, got {bad}")
        dynamic = [t.name for t in tables if t.dynamic is not None]
        if dynamic:
            raise UnsupportedFeatureError(
                f"{_OWNER}: dynamic tables {dynamic} are not quantized as sequence tables; serve the float "
                "EmbeddingCollection, or quantize dynamic tables in an EmbeddingBagCollection"
            )
        check_unique_tables(tables, _OWNER)
        self._dtype = QuantDType.parse(dtype)
        _check_dims(tables, self._dtype)  # type: ignore[arg-type]  # reads names and dims only
        self._tables = list(tables)
        self._need_indices = need_indices
        self.validate_ids = validate_ids
        self.embeddings = TableDict({t.name: QuantTable(t, self._dtype, device) for t in tables})  # type: ignore[arg-type]
        feature_names = [f for t in tables for f in t.feature_names]
        self._names_by_table = embedding_names_by_table(tables)
        self._arrange = FeatureArranger(feature_names, _OWNER, [n for names in self._names_by_table for n in names])
        self._rows = [t.num_embeddings for t in tables for _ in t.feature_names]
        self._table_of = [t.name for t in tables for _ in t.feature_names]

    @classmethod
    def from_float(cls, ec: EmbeddingCollection, dtype: str | QuantDType = QuantDType.INT8) -> QuantEmbeddingCollection:
        """Quantize a trained (unsharded, or loaded from a gathered checkpoint) collection."""
        if ec.device.type == "meta":
            raise ValueError(f"{_OWNER}.from_float: the EmbeddingCollection is on the meta device (no weights); "
                             "load its state dict first")  # fmt: skip
        q = cls(ec.embedding_configs(), dtype, ec.device, ec.need_indices(), validate_ids=ec.validate_ids)
        for t in q._tables:
            emb = ec.embeddings[t.name]
            if not isinstance(emb, nn.Embedding):  # pragma: no cover - EmbeddingCollection builds these
                raise TypeError(f"embeddings.{t.name} is {type(emb).__name__}, not nn.Embedding")
            q.table(t.name).set_rows(quantize_rows(emb.weight.detach(), q._dtype), copy=True)
        return q

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._tables

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._names_by_table

    def embedding_dim(self) -> int:
        """The one embedding dim of every table (as :meth:`EmbeddingCollection.embedding_dim`)."""
        return one_embedding_dim(self._tables, _OWNER)

    @property
    def dtype(self) -> QuantDType:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.table(self._tables[0].name).weight.device

    def table(self, name: str) -> QuantTable:
        module = self.embeddings[name]
        if not isinstance(module, QuantTable):  # pragma: no cover - construction guarantees it
            raise TypeError(f"embeddings.{name} is {type(module).__name__}, not QuantTable")
        return module

    def nbytes(self) -> int:
        """Bytes of the stored rows (scale and bias included)."""
        return sum(self.table(t.name).nbytes() for t in self._tables)

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_script(_OWNER)
        return self

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if is_traced(features):  # torch.fx: one call_module node (modules/fx_trace.py)
            return traced_leaf(self, features, _OWNER)  # type: ignore[no-any-return]
        kjt = self._arrange(features)
        if self.validate_ids:
            check_ids(kjt, self._rows, self._table_of)
        out: dict[str, JaggedTensor] = {}
        for t, sub in zip(self._tables, kjt.split([t.num_features for t in self._tables]), strict=True):
            stored = self.table(t.name).rows()
            ids = sub.values().long()
            scale = None if stored.scale is None else stored.scale[ids]
            bias = None if stored.bias is None else stored.bias[ids]
            rows = dequantize_rows(stored.dtype, stored.data[ids], scale, bias)
            for f, part in zip(sub.keys(), rows.split(sub.length_per_key()), strict=True):
                jt = sub[f]
                out[f] = JaggedTensor(part, jt.values() if self._need_indices else None, lengths=jt.lengths())
        return out


__all__ = ["QuantEmbeddingCollection"]
