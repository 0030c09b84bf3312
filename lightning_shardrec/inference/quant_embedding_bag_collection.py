"""``QuantEmbeddingBagCollection``: an inference-only EmbeddingBagCollection on quantized rows.

Same contract as :class:`~lightning_shardrec.modules.EmbeddingBagCollection`:
``forward(kjt) -> KeyedTensor [B, sum dims]`` with keys in feature order, SUM/MEAN
pooling, optional per-id weights. The rows are stored row-wise quantized (see
:mod:`~lightning_shardrec.inference.rowwise`) as buffers, TorchRec's layout::

    embedding_bags.<table>.weight          uint8 [rows, dim*bits/8]   (fp16 [rows, dim] for fp16)
    embedding_bags.<table>.weight_qscale   fp16  [rows, 1]            (int8/int4 only)
    embedding_bags.<table>.weight_qbias    fp16  [rows, 1]            (int8/int4 only)

Lookups run on fbgemm's integer TBE or the torch fallback
(:class:`~lightning_shardrec.inference.lookup.QuantBackend`); both read these same
bytes, so a state dict written under one backend serves under the other.

A dynamic table (``dynamic=DynamicConfig(...)``) keeps one more, all-zero row
(``[capacity + 1, ...]``) and its frozen id mapping (:mod:`~lightning_shardrec.inference.id_map`)::

    id_maps.<table>.ids                    int64 [capacity]           the raw id each slot (row) holds
    id_maps.<table>.live                   bool  [capacity]           whether the slot serves it

so it serves raw int64 ids as the float module does in ``eval()``: live ids read
their row, any other id reads zeros (and still counts in a MEAN bag's size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import EmbeddingBagConfig, PoolingType
from lightning_shardrec.inference.id_map import QuantIdMap, live_slots
from lightning_shardrec.inference.lookup import FbgemmQuantLookup, QuantBackend, QuantLookup, TorchQuantLookup
from lightning_shardrec.inference.rowwise import QuantDType, QuantizedRows, quantize_rows
from lightning_shardrec.modules import EmbeddingBagCollection
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper
from lightning_shardrec.modules.embedding_bag_collection import check_unique_tables
from lightning_shardrec.modules.features import FeatureArranger, check_ids, embedding_names
from lightning_shardrec.modules.fx_trace import is_traced, refuse_script, traced_leaf
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.modules.vbe import expand_vbe, inverse_rows
from lightning_shardrec.sparse import KeyedJaggedTensor, KeyedTensor


class QuantTable(nn.Module):
    """The stored rows of one table: ``weight`` (+ ``weight_qscale``/``weight_qbias``)."""

    weight: Tensor

    def __init__(self, config: EmbeddingBagConfig, dtype: QuantDType, device: torch.device | str | None) -> None:
        super().__init__()
        self.dtype = dtype
        rows, dim = config.num_embeddings + (config.dynamic is not None), config.embedding_dim  # + zero row
        if dtype is QuantDType.FP16:
            self.register_buffer("weight", torch.zeros(rows, dim, dtype=torch.float16, device=device))
        else:
            self.register_buffer("weight", torch.zeros(rows, dim * dtype.bits // 8, dtype=torch.uint8, device=device))
            self.register_buffer("weight_qscale", torch.ones(rows, 1, dtype=torch.float16, device=device))
            self.register_buffer("weight_qbias", torch.zeros(rows, 1, dtype=torch.float16, device=device))

    def rows(self) -> QuantizedRows:
        return QuantizedRows(
            dtype=self.dtype,
            data=self.weight,
            scale=getattr(self, "weight_qscale", None),
            bias=getattr(self, "weight_qbias", None),
        )

    def set_rows(self, rows: QuantizedRows, *, copy: bool) -> None:
        """Copy ``rows`` into the buffers (``copy=True``) or make the buffers *be* them."""
        pairs: list[tuple[str, Tensor | None]] = [("weight", rows.data)]
        if self.dtype.has_scale_bias:
            pairs += [("weight_qscale", rows.scale), ("weight_qbias", rows.bias)]
        for name, value in pairs:
            if value is None:
                raise ValueError(f"QuantTable: {self.dtype.value} rows lack {name}")
            if copy:
                self._buffers[name].copy_(value)  # type: ignore[union-attr]
            else:
                self._buffers[name] = value

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class QuantEmbeddingBagCollection(nn.Module):
    """Pooled lookups of row-wise quantized tables: ``forward(kjt) -> KeyedTensor``.

    Build one from a trained collection with :meth:`from_float` (or
    :func:`lightning_shardrec.inference.quantize`); the constructor allocates empty
    rows for ``load_state_dict``. ``backend``: ``"auto"`` (fbgemm on CPU when it
    loads), ``"fbgemm"`` or ``"torch"``.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        dtype: str | QuantDType = QuantDType.INT8,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        backend: str | QuantBackend = QuantBackend.AUTO,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("QuantEmbeddingBagCollection needs at least one EmbeddingBagConfig")
        check_unique_tables(tables, "QuantEmbeddingBagCollection")
        self._dtype = QuantDType.parse(dtype)
        self._backend = QuantBackend.parse(backend)
        _check_dims(tables, self._dtype)
        self._tables = list(tables)
        self._is_weighted = is_weighted
        self.validate_ids = validate_ids
        self.embedding_bags = TableDict({t.name: QuantTable(t, self._dtype, device) for t in tables})
        dynamic = {t.name: QuantIdMap(t.name, t.dynamic, t.num_embeddings, device) for t in tables if t.dynamic}
        self.id_maps = TableDict(dynamic) if dynamic else None
        self._feature_names = [f for t in tables for f in t.feature_names]
        self._embedding_names = embedding_names(tables)  # feature@table for a feature several tables read
        self._arrange = FeatureArranger(
            self._feature_names, "QuantEmbeddingBagCollection", self._embedding_names, is_weighted=is_weighted
        )
        self._rows = [t.num_embeddings + (t.dynamic is not None) for t in tables for _ in t.feature_names]
        self._table_of = [t.name for t in tables for _ in t.feature_names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._mean = [t.pooling is PoolingType.MEAN for t in tables for _ in t.feature_names]
        self._lookup: QuantLookup | None = None
        self._lookup_key: tuple[object, ...] = ()

    @classmethod
    def from_float(
        cls,
        ebc: EmbeddingBagCollection,
        dtype: str | QuantDType = QuantDType.INT8,
        *,
        backend: str | QuantBackend = QuantBackend.AUTO,
    ) -> QuantEmbeddingBagCollection:
        """Quantize a trained (unsharded, or loaded from a gathered checkpoint) collection."""
        device = ebc.device
        if device.type == "meta":
            raise ValueError(
                "QuantEmbeddingBagCollection.from_float: the EmbeddingBagCollection is on the meta device "
                "(no weights); load its state dict first"
            )
        q = cls(
            ebc.embedding_bag_configs(),
            dtype,
            ebc.is_weighted(),
            device,
            backend=backend,
            validate_ids=ebc.validate_ids,
        )
        for t in q._tables:
            bag = ebc.embedding_bags[t.name]
            if not isinstance(bag, nn.EmbeddingBag):  # pragma: no cover - EmbeddingBagCollection builds these
                raise TypeError(f"embedding_bags.{t.name} is {type(bag).__name__}, not nn.EmbeddingBag")
            weight = bag.weight.detach()
            if t.dynamic is not None and ebc.dynamic_tables is not None:
                weight = q._freeze_ids(t.name, ebc.dynamic_tables.mapper(t.name), weight)
            rows = quantize_rows(weight, q._dtype)
            q.table(t.name).set_rows(rows, copy=True)
        return q

    def _freeze_ids(self, table: str, mapper: DynamicIdMapper, weight: Tensor) -> Tensor:
        """Keep ``mapper``'s live ids; return ``weight`` with only their rows, plus the zero row."""
        id_map = self.id_map(table)
        id_map.set_live(*live_slots(mapper))
        keep = torch.zeros(weight.shape[0] + 1, 1, dtype=torch.bool, device=weight.device)
        keep[id_map.live_rows().to(weight.device)] = True
        padded = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
        return torch.where(keep, padded, 0.0)  # free and expired rows are stored as zeros too

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    def feature_names(self) -> list[str]:
        return self._feature_names

    @property
    def dtype(self) -> QuantDType:
        return self._dtype

    @property
    def backend(self) -> QuantBackend:
        """The backend that serves the next lookup (AUTO resolved for the rows' device)."""
        return self._backend.resolve(self.device)

    def set_backend(self, backend: str | QuantBackend) -> None:
        """Serve later lookups from ``backend`` (the stored rows stay as they are)."""
        self._backend = QuantBackend.parse(backend)

    @property
    def device(self) -> torch.device:
        return self.table(self._tables[0].name).weight.device

    def table(self, name: str) -> QuantTable:
        module = self.embedding_bags[name]
        if not isinstance(module, QuantTable):  # pragma: no cover - construction guarantees it
            raise TypeError(f"embedding_bags.{name} is {type(module).__name__}, not QuantTable")
        return module

    def id_map(self, name: str) -> QuantIdMap:
        """Dynamic table ``name``'s raw id -> row mapping."""
        module = None if self.id_maps is None else self.id_maps._modules.get(name)
        if not isinstance(module, QuantIdMap):
            dynamic = [] if self.id_maps is None else sorted(self.id_maps.keys())
            raise KeyError(f"QuantEmbeddingBagCollection: table {name!r} is not dynamic; dynamic tables: {dynamic}")
        return module

    def nbytes(self) -> int:
        """Bytes of the stored rows (scale/bias included) and of the dynamic tables' id maps."""
        id_maps = 0 if self.id_maps is None else sum(b.nbytes for b in self.id_maps.buffers())
        return sum(self.table(t.name).nbytes() for t in self._tables) + id_maps

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_script("QuantEmbeddingBagCollection")
        return self

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_traced(features):  # torch.fx: one call_module node (modules/fx_trace.py)
            return traced_leaf(self, features, "QuantEmbeddingBagCollection")
        kjt = self._arrange(features)
        if kjt.variable_stride_per_key():  # VBE: look up the expanded batch (the same rows as pool-then-expand)
            kjt = expand_vbe(kjt, inverse_rows(features, self._feature_names, "QuantEmbeddingBagCollection"))
        if self.id_maps is not None:
            kjt = self._map_ids(kjt)
        weights = kjt.weights_or_none() if self._is_weighted else None
        if self._is_weighted and weights is None:
            raise ValueError("QuantEmbeddingBagCollection(is_weighted=True) got a KeyedJaggedTensor without weights")
        if self.validate_ids:
            check_ids(kjt, self._rows, self._table_of)
        pooled = self._current_lookup()(kjt, weights)
        if any(self._mean):
            pooled = pooled / self._mean_divisor(kjt.lengths(), kjt.stride())
        return KeyedTensor(self._embedding_names, self._dims, pooled)

    def _map_ids(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with each dynamic table's raw ids replaced by their rows (the zero row if not live)."""
        values, starts = kjt.values().long(), kjt.offset_per_key()
        parts, k = [], 0
        for t in self._tables:
            part = values[starts[k] : starts[k + t.num_features]]
            parts.append(part if t.dynamic is None else self.id_map(t.name)(part))
            k += t.num_features
        parts.append(values[starts[-1] :])  # a tail past the last bag is no id
        return KeyedJaggedTensor._trusted(
            kjt.keys(), torch.cat(parts), kjt.weights_or_none(), kjt.lengths(), kjt.stride(), kjt.length_per_key()
        )

    def _mean_divisor(self, lengths: Tensor, batch: int) -> Tensor:
        """``[B, sum dims]``: the bag size under MEAN features, 1 under SUM ones."""
        per_feature = lengths.view(len(self._dims), batch).clamp(min=1).to(torch.float32)
        mean = torch.tensor(self._mean, device=lengths.device).unsqueeze(1)
        per_feature = torch.where(mean, per_feature, torch.ones_like(per_feature))
        dims = torch.tensor(self._dims, device=lengths.device)
        return per_feature.repeat_interleave(dims, dim=0, output_size=sum(self._dims)).t()

    def _current_lookup(self) -> QuantLookup:
        """The lookup for the current buffers, rebuilt when they were replaced (``.to``, ``_apply``)."""
        if self._lookup is not None and torch.compiler.is_compiling():
            return self._lookup  # traced buffers have no data pointer; torch.export traces the lookup built eagerly
        key = self._buffers_key()
        if self._lookup is None or key != self._lookup_key:
            names = [t.name for t in self._tables]
            rows = [self.table(n).rows() for n in names]
            features = [t.num_features for t in self._tables]
            with torch.inference_mode(False):  # built under Trainer.predict: keep the rows loadable later
                self._build_lookup(names, rows, features)
            self._lookup_key = self._buffers_key()
        return self._lookup  # type: ignore[return-value]

    def _build_lookup(self, names: list[str], rows: list[QuantizedRows], features: Sequence[int]) -> None:
        if self.backend is QuantBackend.FBGEMM:
            lookup = FbgemmQuantLookup(names, rows, features, bounds_check=not self.validate_ids)
            for name, stored in zip(names, lookup.stored_rows([r.dtype for r in rows]), strict=True):
                self.table(name).set_rows(stored, copy=False)  # one copy of the rows: the TBE's
            self._lookup = lookup
        else:
            self._lookup = TorchQuantLookup(rows, features)

    def _buffers_key(self) -> tuple[object, ...]:
        return (self._backend, *((b.device, b.data_ptr()) for b in self.buffers()))


def _check_dims(tables: list[EmbeddingBagConfig], dtype: QuantDType) -> None:
    """Every table's dim must pack into 2-byte-aligned rows (fbgemm's rule, kept for both backends)."""
    bad = [f"'{t.name}' dim {t.embedding_dim}" for t in tables if t.embedding_dim % dtype.dim_multiple]
    if bad:
        raise ValueError(
            f"QuantEmbeddingBagCollection: {dtype.value} needs embedding_dim a multiple of {dtype.dim_multiple} "
            f"(rows of dim*{dtype.bits}/8 bytes + fp16 scale/bias must be 2-byte aligned); tables: "
            + ", ".join(bad)
            + "; choose another dtype (fp16 takes any dim) or pad the tables"
        )
