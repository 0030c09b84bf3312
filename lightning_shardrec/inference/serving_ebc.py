"""``ServingEmbeddingBags``: a quantized collection in plain aten ops, for ``torch.export``.

:class:`~lightning_shardrec.inference.QuantEmbeddingBagCollection` serves through fbgemm's
TBE or a compiled id-map loop and checks ids against the tables in Python; none of that
traces. This module computes the same pooled bags (the torch backend's arithmetic, so the
outputs are equal) with ops ``torch.export`` keeps and AOTInductor compiles:

* the KJT's ids are split per input key by their counts (``lengths.view(K, B).sum(1)``,
  data-dependent sizes the exported program checks at run time), so the batch size ``B``
  and the number of ids stay dynamic;
* each table gathers its ids' stored rows, dequantizes only those (``scale * q + bias``)
  and SUM-pools them with ``embedding_bag``; MEAN divides by the bag size;
* a dynamic table first maps raw ids to rows by binary search in its frozen live ids
  (:func:`~lightning_shardrec.inference.id_map.lookup_sorted`), the zero row when not live.

Buffers (contiguous copies of the quantized collection's)::

    embedding_bags.<table>.weight / weight_qscale / weight_qbias   as QuantEmbeddingBagCollection
    id_maps.<table>.keys  int64 [n]   the live raw ids, ascending
    id_maps.<table>.rows  int64 [n]   the row each reads
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.configs import PoolingType
from lightning_shardrec.inference.id_map import lookup_sorted, sorted_live
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection, QuantTable
from lightning_shardrec.inference.rowwise import QuantDType, QuantizedRows, dequantize_rows
from lightning_shardrec.modules.features import embedding_names_by_table
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.sparse import KeyedJaggedTensor, KeyedTensor


class SortedIdMap(nn.Module):
    """A dynamic table's frozen id map as ``keys``/``rows`` (see :func:`lookup_sorted`)."""

    keys: Tensor
    rows: Tensor

    def __init__(self, keys: Tensor, rows: Tensor, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.register_buffer("keys", keys.contiguous().clone())
        self.register_buffer("rows", rows.contiguous().clone())

    def forward(self, ids: Tensor) -> Tensor:
        return lookup_sorted(self.keys, self.rows, ids, self.capacity)


class ServingEmbeddingBags(nn.Module):
    """``forward(kjt) -> KeyedTensor [B, sum dims]``, equal to the quantized collection's (torch backend)."""

    def __init__(self, qebc: QuantEmbeddingBagCollection) -> None:
        super().__init__()
        self._dtype: QuantDType = qebc.dtype
        self._tables = list(qebc.embedding_bag_configs())
        self._is_weighted = qebc.is_weighted()
        self.embedding_bags = TableDict({t.name: _copy(qebc.table(t.name), t, self._dtype) for t in self._tables})
        dynamic = {
            t.name: SortedIdMap(*sorted_live(qebc.id_map(t.name)), t.num_embeddings)
            for t in self._tables
            if t.dynamic is not None
        }
        self.id_maps = TableDict(dynamic) if dynamic else None
        self._names = embedding_names_by_table(self._tables)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.variable_stride_per_key():
            raise ValueError(
                "ServingEmbeddingBags: a variable-batch (VBE) KeyedJaggedTensor cannot be exported; "
                "expand it to one batch size per key first"
            )
        keys = features.keys()
        index = {k: i for i, k in enumerate(keys)}
        needed = [f for t in self._tables for f in t.feature_names]
        missing = [f for f in dict.fromkeys(needed) if f not in index]
        if missing:
            raise KeyError(
                f"ServingEmbeddingBags: input KeyedJaggedTensor lacks features {missing}; it has keys {keys}"
            )
        values, batch = features.values().long(), features.stride()
        lengths = features.lengths().long().split([batch] * len(keys))  # [B] per key (a [K, B] view would fix B != 1)
        weights = features.weights().float() if self._is_weighted else None
        segments, weight_segments = _split_by_key(values, weights, lengths)
        out, names, dims = [], [], []
        for t, table_names in zip(self._tables, self._names, strict=True):
            ks = [index[f] for f in t.feature_names]
            ids = _cat([segments[k] for k in ks])
            bag_lengths = _cat([lengths[k] for k in ks])
            if self.id_maps is not None and t.name in self.id_maps:
                ids = self.id_maps[t.name](ids)
            w = None if weight_segments is None else _cat([weight_segments[k] for k in ks])
            pooled = self._pool(t.name, ids, bag_lengths, w).view(len(ks), batch, t.embedding_dim)
            if t.pooling is PoolingType.MEAN:
                pooled = pooled / bag_lengths.view(len(ks), batch, 1).clamp(min=1).to(torch.float32)
            out += list(pooled.unbind(0))  # [B, dim] per feature (no reshape of a transpose: B stays free)
            names += table_names
            dims += [t.embedding_dim] * len(ks)
        return KeyedTensor(names, dims, torch.cat(out, dim=1))

    def _pool(self, table: str, ids: Tensor, bag_lengths: Tensor, weights: Tensor | None) -> Tensor:
        """SUM-pooled ``[bags, dim]``: the torch backend's gather, dequantize, ``embedding_bag``."""
        rows: QuantizedRows = self.embedding_bags[table].rows()  # type: ignore[operator]
        check_rows(ids, rows.data.shape[0], f"ServingEmbeddingBags: table {table!r}")
        gathered = dequantize_rows(
            rows.dtype,
            rows.data[ids],
            None if rows.scale is None else rows.scale[ids],
            None if rows.bias is None else rows.bias[ids],
        )
        offsets = torch.cat([bag_lengths.new_zeros(1), bag_lengths.cumsum(0)])
        return F.embedding_bag(
            torch.arange(ids.numel(), device=ids.device),
            gathered,
            offsets,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )


def check_rows(ids: Tensor, num_rows: int, where: str) -> None:
    """Fail the request (an error, not a crash or another row) when an id is outside ``[0, num_rows)``."""
    outside = ((ids < 0) | (ids >= num_rows)).any()
    compat.assert_async(outside.logical_not(), f"{where}: an id is outside [0, {num_rows})")


def _split_by_key(
    values: Tensor, weights: Tensor | None, lengths: Sequence[Tensor]
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...] | None]:
    """``values`` (and ``weights``) split into the ids of each key (``lengths``: ``[B]`` per key); a tail is
    dropped."""
    counts: list[int] = torch.stack([n.sum() for n in lengths]).tolist()
    for c in counts:
        compat.check(c >= 0)
    tail = values.shape[0] - sum(counts)
    compat.check(tail >= 0, lambda: "ServingEmbeddingBags: lengths sum past the number of ids")
    sizes = [*counts, tail]
    return values.split(sizes), None if weights is None else weights.split(sizes)


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _copy(table: QuantTable, config: object, dtype: QuantDType) -> QuantTable:
    """A contiguous copy of ``table``'s rows (fbgemm's are views of its fused storage)."""
    copy = QuantTable(config, dtype, "meta")  # type: ignore[arg-type]
    rows = table.rows()
    copy.set_rows(
        QuantizedRows(
            dtype=dtype,
            data=rows.data.contiguous().clone(),
            scale=None if rows.scale is None else rows.scale.contiguous().clone(),
            bias=None if rows.bias is None else rows.bias.contiguous().clone(),
        ),
        copy=False,
    )
    return copy
