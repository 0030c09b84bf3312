"""``torch.fx`` symbolic tracing of the collections, as TorchRec supports it.

Under ``torch.fx.symbolic_trace`` (or :mod:`lightning_shardrec.fx`) a collection's ``forward`` gets a
``Proxy`` for its ``KeyedJaggedTensor`` instead of one. It then records what its eager forward computes,
one feature at a time, with operations a graph can hold::

    jt = features["f1"]                                        # call_function getitem: the feature's bags
    rows = F.embedding_bag(jt.values().long(), <weight>, jt.offsets().long(), mode="sum", ...)
    out = keyed_tensor(["f1", ...], [dim, ...], torch.cat([rows, ...], dim=1))   # one node

The weights are ``get_attr`` nodes, so the graph module holds the same parameters. Per bag the sums run
over the same rows in the same order as eager. What the graph leaves out: the id range check (an
out-of-range id raises torch's ``IndexError`` there), variable-batch (VBE) inputs and dynamic tables
(refused when tracing, by name).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.sparse import JaggedTensor, KeyedTensor


def keyed_tensor(keys: list[str], length_per_key: list[int], values: Tensor) -> KeyedTensor:
    """``KeyedTensor(keys, length_per_key, values)``: one graph node (``torch.fx.wrap``)."""
    return KeyedTensor(keys, length_per_key, values)


def jagged_tensor(values: Tensor, lengths: Tensor, weights: Tensor | None) -> JaggedTensor:
    """``JaggedTensor(values, weights, lengths=lengths)``: one graph node (``torch.fx.wrap``)."""
    return JaggedTensor(values, weights, lengths=lengths)


torch.fx.wrap("keyed_tensor")
torch.fx.wrap("jagged_tensor")


def is_traced(features: object) -> bool:
    """``features`` is an fx ``Proxy``: the collection is being symbolically traced."""
    return isinstance(features, torch.fx.Proxy)


def _refuse_dynamic(module: Any, owner: str) -> None:
    dyn = getattr(module, "dynamic_tables", None)
    if dyn is not None:
        raise UnsupportedFeatureError(
            f"torch.fx.symbolic_trace of {owner}: dynamic tables {sorted(dyn.keys())} cannot be traced (their "
            "id map is data-dependent Python); trace a collection of static tables, or use torch.export"
        )


def traced_pooled(module: Any, features: Any) -> Any:
    """The graph of an ``EmbeddingBagCollection`` forward on ``features`` (a ``Proxy``)."""
    _refuse_dynamic(module, "EmbeddingBagCollection")
    pooled = []
    for t in module.embedding_bag_configs():
        bag: nn.EmbeddingBag = module.embedding_bags[t.name]
        for f in t.feature_names:
            jt = features[f]
            weights = jt.weights() if module.is_weighted() else None
            mode = "mean" if t.pooling.value == "MEAN" else "sum"
            pooled.append(
                F.embedding_bag(
                    jt.values().long(), bag.weight, jt.offsets().long(), mode=mode,
                    per_sample_weights=weights, include_last_offset=True,
                )  # fmt: skip
            )
    dims = [t.embedding_dim for t in module.embedding_bag_configs() for _ in t.feature_names]
    return keyed_tensor(list(module.embedding_names()), dims, torch.cat(pooled, dim=1))


def traced_sequence(module: Any, features: Any, names_by_table: list[list[str]]) -> dict[str, Any]:
    """The graph of an ``EmbeddingCollection`` forward on ``features`` (a ``Proxy``)."""
    _refuse_dynamic(module, "EmbeddingCollection")
    out: dict[str, Any] = {}
    for t, names in zip(module.embedding_configs(), names_by_table, strict=True):
        weight = module.embeddings[t.name].weight
        for f, name in zip(t.feature_names, names, strict=True):
            jt = features[f]
            ids = jt.values()
            indices = ids if module.need_indices() else None
            out[name] = jagged_tensor(F.embedding(ids.long(), weight), jt.lengths(), indices)
    return out


def traced_leaf(module: nn.Module, features: Any, owner: str) -> Any:
    """``module(features)`` recorded as one ``call_module`` node (a collection traced as a leaf); traced as the
    root itself, a named error."""
    tracer = features.tracer
    path = tracer.path_of_module(module)
    if not path:
        raise UnsupportedFeatureError(
            f"torch.fx tracing of a {owner} as the root is not supported: its lookups are not graph operations; "
            "trace a module that holds it (it becomes one call_module node), or export it with "
            "torch.export.export(model, (kjt,), strict=False)"
        )
    return tracer.create_proxy("call_module", path, (features,), {})


def refuse_script(owner: str) -> None:
    """``torch.jit.script`` of a collection: a named error (``__prepare_scriptable__``)."""
    raise UnsupportedFeatureError(
        f"torch.jit.script of {owner} is not supported: the sparse types here are Python classes TorchScript "
        "cannot compile. Use torch.fx.symbolic_trace (a GraphModule that runs in Python) or torch.export.export"
        "(model, (kjt,), strict=False) for a program to serve (docs/migrating.md, 'Modules')"
    )


__all__ = [
    "is_traced",
    "jagged_tensor",
    "keyed_tensor",
    "refuse_script",
    "traced_leaf",
    "traced_pooled",
    "traced_sequence",
]
