"""What every embedding collection (sharded or not) does to its input KJT first.

* :func:`embedding_names_by_table`: each table's output names; a feature read by
  several tables is named ``feature@table`` (TorchRec's rule).
* :class:`FeatureArranger` puts the KJT's keys in the collection's feature order
  (a no-op when they already are; extra keys are dropped; a shared feature is
  repeated and renamed to its embedding names), caching the permutation.
* :func:`check_ids` rejects ids outside ``[0, num_embeddings)`` with a message
  naming the feature, its table, the id and the range — one vectorised pass.
* :class:`IdRanges` is the same check on the device (CUDA): a flag, no host sync of its own;
  the input distribution reads it with the batch header and then names the bad id with
  :func:`check_ids`. :func:`checks_on_device` says which of the two a device gets.
* :func:`check_id_tensor` checks what a KJT must hold to be looked up: 1-D integer
  ids (a KJT itself may hold anything, as in TorchRec) and, for weighted lookups,
  1-D float weights. Values past the last bag are dropped before the lookup.
"""

from __future__ import annotations

import copy
import dataclasses
from bisect import bisect_right
from collections.abc import Sequence
from typing import TypeVar

import torch

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.errors import IdOutOfRangeError
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.sparse.pytree import _tracing

_C = TypeVar("_C", bound=BaseEmbeddingConfig)


def embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Per table, the output name of each of its features: ``feature@table`` when shared."""
    count: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f"{f}@{t.name}" if count[f] > 1 else f for f in t.feature_names] for t in tables]


def embedding_names(tables: Sequence[BaseEmbeddingConfig]) -> list[str]:
    """Every table's output names, table by table (the collection's internal key order)."""
    return [n for names in embedding_names_by_table(tables) for n in names]


def unshare_features(tables: Sequence[_C]) -> list[_C]:
    """``tables`` with ``feature_names`` replaced by their embedding names (unique keys)."""
    return [
        t if names == t.feature_names else dataclasses.replace(t, feature_names=names)
        for t, names in zip(tables, embedding_names_by_table(tables), strict=True)
    ]


class FeatureArranger:
    """Reorders KJT keys into ``feature_names`` (cached per distinct key order).

    ``feature_names`` may repeat a key (a feature read by several tables); the output
    keys are then ``names`` (unique, e.g. ``f@table``), one per entry.
    """

    def __init__(
        self, feature_names: list[str], owner: str, names: list[str] | None = None, *, is_weighted: bool = False
    ) -> None:
        self.feature_names = list(feature_names)
        self.names = self.feature_names if names is None else list(names)
        self._renamed = self.names != self.feature_names
        self._owner = owner
        self._is_weighted = is_weighted
        self._cache: dict[tuple[str, ...], list[int] | None] = {}

    def __call__(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"{self._owner}.forward takes a KeyedJaggedTensor of features {self.feature_names}, "
                f"got {type(features).__name__}"
            )
        features = check_id_tensor(features, self._owner, self._is_weighted)
        keys = tuple(features.keys())
        if keys not in self._cache:
            self._cache[keys] = self._permutation(list(keys))
        perm = self._cache[keys]
        out = features if perm is None else features.permute(perm)
        return rename_keys(out, self.names) if self._renamed else out

    def _permutation(self, keys: list[str]) -> list[int] | None:
        if keys == self.feature_names:
            return None
        index = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self.feature_names if f not in index]
        if missing:
            raise KeyError(
                f"{self._owner}: input KeyedJaggedTensor lacks features {missing}; "
                f"it has keys {keys}, the collection needs {list(dict.fromkeys(self.feature_names))}"
            )
        return [index[f] for f in self.feature_names]


def rename_keys(features: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    """The same KJT (tensors shared) under new key names, one per key."""
    out = copy.copy(features)
    out._keys = list(keys)
    out._index_per_key = None
    return out


def check_id_tensor(features: KeyedJaggedTensor, owner: str, is_weighted: bool = False) -> KeyedJaggedTensor:
    """``features`` ready to look up: 1-D integer ids (float weights if weighted), no tail."""
    values, weights, keys = features.values(), features.weights_or_none(), features.keys()
    if values.dim() != 1:
        raise ValueError(f"{owner}: KeyedJaggedTensor values must be 1-D ids, got shape {tuple(values.shape)}")
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{owner}: KeyedJaggedTensor ids must be integers, got dtype {values.dtype} for keys {keys}")
    if is_weighted and weights is not None and not weights.is_floating_point():
        raise ValueError(
            f"{owner}(is_weighted=True): weights must be a 1-D float tensor (one per id), "
            f"got shape {tuple(weights.shape)} dtype {weights.dtype}"
        )
    if values.device.type == "meta":
        return features
    total = features.offset_per_key()[-1] if keys else 0
    if _tracing(values):  # torch.export: a hint, not a branch on data (the program takes KJTs without a tail)
        compat.check(values.shape[0] == total, lambda: f"{owner}: the ids must be exactly sum(lengths)")
        return features
    if values.shape[0] == total and (weights is None or weights.shape[0] == total):
        return features
    return KeyedJaggedTensor._trusted(  # the tail past the last bag is no id of any feature
        keys,
        values[:total],
        None if weights is None else weights[:total],
        features.lengths(),
        features.stride(),
        features.length_per_key(),
        stride_per_key_per_rank=features._stride_per_key_per_rank,
        inverse_indices=features.inverse_indices_or_none(),
    )


def check_ids(features: KeyedJaggedTensor, num_embeddings: list[int], table_names: list[str]) -> None:
    """Raise ``ValueError`` for the first id outside its table's ``[0, num_embeddings)``.

    ``features`` is already in collection order; entry ``f`` of the lists belongs to
    key ``f``.
    """
    if _tracing(features.values()) and not features.variable_stride_per_key():
        _assert_ids(features, num_embeddings, table_names)
        return
    values = features.values()[: features.offset_per_key()[-1]]  # a tail past the last bag is no id
    if values.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(values)).tolist()  # one read (one host sync on CUDA)
    if low >= 0 and high < min(num_embeddings):  # one pass settles the common case
        return
    lpk = features.length_per_key()
    if low >= 0:  # only keys whose table is smaller than the largest id can hold a bad one: their maxima
        starts = features.offset_per_key()
        small = [k for k, n in enumerate(num_embeddings) if n <= high and lpk[k]]
        if not small:
            return
        maxima = torch.stack([values[starts[k] : starts[k + 1]].max() for k in small]).tolist()
        if all(m < num_embeddings[k] for m, k in zip(maxima, small, strict=True)):
            return
    limits = torch.tensor(num_embeddings, device=values.device).repeat_interleave(
        torch.tensor(lpk, device=values.device), output_size=values.numel()
    )
    bad = (values < 0) | (values >= limits)
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0])
    f = bisect_right(features.offset_per_key(), i) - 1
    raise IdOutOfRangeError(
        f"feature '{features.keys()[f]}' (table '{table_names[f]}'): id {int(values[i])} "
        f"outside [0, {num_embeddings[f]})",
        feature=features.keys()[f],
        value=int(values[i]),
    )


def _assert_ids(features: KeyedJaggedTensor, num_embeddings: list[int], table_names: list[str]) -> None:
    """:func:`check_ids` inside ``torch.export``: no branch on the data, a runtime assert in the program."""
    values = features.values()
    counts = features.lengths().view(len(num_embeddings), -1).sum(1)
    limits = torch.tensor(num_embeddings, device=values.device).repeat_interleave(counts, output_size=values.shape[0])
    ok = ((values >= 0) & (values < limits)).all()
    tables = ", ".join(f"'{t}' [0, {n})" for t, n in zip(table_names, num_embeddings, strict=True))
    compat.assert_async(ok, f"an id is outside its table's range ({tables})")


def checks_on_device(device: torch.device) -> bool:
    """Whether ids on ``device`` are checked with :class:`IdRanges` (a flag computed on the device and
    read with the batch header) rather than by :func:`check_ids` on the host: on every device but the
    CPU, where reading the ids costs no sync. (``gpu_check``'s GPU code path turns it on for the CPU.)"""
    return device.type != "cpu"


class IdRanges:
    """Each feature's valid ids, checked on the ids' device: ``[0, num_embeddings)``, or any int64 for
    the features of dynamic tables (positions not in ``static``; ``static=None``: every feature is static)."""

    def __init__(self, num_embeddings: list[int], table_names: list[str], static: list[int] | None) -> None:
        self.num_embeddings, self.table_names, self.static = list(num_embeddings), list(table_names), static
        self._bounds: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def out_of_range(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """0-d bool on the ids' device: whether any id lies outside its feature's range (no host sync).

        ``features``: in collection order, one batch size for every key, no values past the last bag.
        """
        values = features.values()
        high, checked = self._bounds_on(values.device)
        if values.numel() == 0 or not self.num_embeddings:
            return torch.zeros((), dtype=torch.bool, device=values.device)
        per_key = features.lengths().view(len(self.num_embeddings), -1).sum(1)
        n = values.numel()
        hi = high.repeat_interleave(per_key, output_size=n)  # output_size: CUDA reads no sum back
        ids = values.long()
        bad = (ids < 0) | (ids >= hi)
        if checked is not None:
            bad &= checked.repeat_interleave(per_key, output_size=n)
        return bad.any()

    def explain(self, features: KeyedJaggedTensor) -> None:
        """Raise :func:`check_ids`' named error for the first bad id (reads the ids: only after a flag)."""
        static = self.static
        if static is None:
            check_ids(features, self.num_embeddings, self.table_names)
        elif static:
            rows, names = [self.num_embeddings[i] for i in static], [self.table_names[i] for i in static]
            check_ids(features.permute(static), rows, names)

    def _bounds_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per feature: ``num_embeddings`` and, with dynamic tables, whether it is checked (static)."""
        if device not in self._bounds:
            high = torch.tensor(self.num_embeddings, dtype=torch.long)
            checked = None
            if self.static is not None:
                checked = torch.zeros(len(self.num_embeddings), dtype=torch.bool)
                checked[self.static] = True
            self._bounds[device] = (high.to(device), None if checked is None else checked.to(device))
        return self._bounds[device]
