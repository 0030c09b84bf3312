"""The sparse types as pytree nodes (torch's pytree registry, through :mod:`lightning_shardrec._compat.torch`),
with TorchRec's leaves.

``tree_flatten`` gives the tensors, the keys go in the spec:

* ``JaggedTensor``: ``[values, weights, lengths, offsets]``.
* ``KeyedJaggedTensor``: ``[values, weights, lengths, offsets, stride_per_key_per_rank
  (an int tensor or None), inverse-indices tensor (or None)]``, context ``keys``. Fewer
  leaves (an older spec) mean ``None`` for the rest; more raise ``ValueError``.
* ``KeyedTensor``: ``[values]``, context ``(keys, length_per_key, key_dim)``;
  ``tree_flatten_spec`` of a KeyedTensor with the same keys in another order gives the
  values in the spec's key order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.sparse.jagged_tensor import JaggedTensor
from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from lightning_shardrec.sparse.keyed_tensor import KeyedTensor

_KJT_LEAVES = ("values", "weights", "lengths", "offsets", "stride_per_key_per_rank", "inverse_indices")


def _jt_flatten(jt: JaggedTensor) -> tuple[list[Tensor | None], None]:
    return [jt._values, jt._weights, jt._lengths, jt._offsets], None


def _jt_unflatten(leaves: Iterable[Any], context: Any) -> JaggedTensor:
    return JaggedTensor(*leaves)


def _kjt_leaves(kjt: KeyedJaggedTensor) -> list[Tensor | None]:
    spkpr = kjt._stride_per_key_per_rank
    inverse = kjt._inverse_indices
    return [
        kjt._values,
        kjt._weights,
        kjt._lengths,
        kjt._offsets,
        None if spkpr is None else torch.tensor(spkpr, dtype=torch.int32).reshape(len(spkpr), -1),
        None if inverse is None else inverse[1],
    ]


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list[Tensor | None], list[str]]:
    return _kjt_leaves(kjt), kjt.keys()


def _tracing(*tensors: Tensor | None) -> bool:
    """Whether ``tensors`` are being traced (fake tensors of ``torch.export``/``torch.compile``)."""
    if torch.compiler.is_compiling():
        return True
    # plain tensors are real (a fake one is a subclass): no need to ask for a fake mode, a few us each batch
    return not all(t is None or type(t) is Tensor for t in tensors) and compat.detect_fake(tensors)


def _kjt_unflatten(leaves: Iterable[Any], context: Any) -> KeyedJaggedTensor:
    leaves = list(leaves)
    if len(leaves) > len(_KJT_LEAVES):
        raise ValueError(
            f"KeyedJaggedTensor takes at most {len(_KJT_LEAVES)} pytree leaves {list(_KJT_LEAVES)}, got {len(leaves)}"
        )
    padded: list[Tensor | None] = [*leaves, *[None] * (len(_KJT_LEAVES) - len(leaves))]
    values, weights, lengths, offsets, spkpr, inverse = padded
    if lengths is not None and spkpr is None and inverse is None and _tracing(values, lengths):
        # torch.export rebuilds its input from fake leaves: no data to check (the traced ops keep theirs)
        kjt = KeyedJaggedTensor._trusted(list(context), values, weights, lengths, lengths.shape[0] // len(context))  # type: ignore[arg-type]
        kjt._offsets = offsets
        return kjt
    return KeyedJaggedTensor(
        context,
        values,  # type: ignore[arg-type]
        weights,
        lengths,
        offsets,
        stride_per_key_per_rank=spkpr,  # type: ignore[arg-type]  # a [K, R] tensor, as TorchRec's
        inverse_indices=None if inverse is None else (list(context), inverse),
    )


def _kt_flatten(kt: KeyedTensor) -> tuple[list[Tensor], tuple[list[str], list[int], int]]:
    return [kt.values()], (kt.keys(), kt.length_per_key(), kt.key_dim())


def _with_keys(flatten: Any, names: tuple[str, ...]) -> Any:
    """``flatten`` with each leaf named by attribute (``GetAttrKey``): what ``torch.export`` needs."""

    def flatten_with_keys(node: Any) -> tuple[list[tuple[compat.KeyEntry, Any]], Any]:
        leaves, context = flatten(node)
        return [(compat.GetAttrKey(n), leaf) for n, leaf in zip(names, leaves, strict=True)], context

    return flatten_with_keys


def _kt_unflatten(leaves: Iterable[Any], context: Any) -> KeyedTensor:
    keys, length_per_key, *rest = context
    return KeyedTensor(keys, length_per_key, next(iter(leaves)), *rest)


def _kt_flatten_spec(kt: KeyedTensor, spec: compat.TreeSpec) -> list[Tensor]:
    keys = spec.context[0]
    if kt.keys() == list(keys):
        return [kt.values()]
    parts = kt.to_dict()
    return [torch.cat([parts[k] for k in keys], dim=kt.key_dim())]


def register() -> None:
    """Register the three types once (done on importing :mod:`lightning_shardrec.sparse`)."""
    if compat.is_pytree_node(JaggedTensor):
        return
    compat.register_pytree_node(
        JaggedTensor,
        _jt_flatten,
        _jt_unflatten,
        name="lightning_shardrec.JaggedTensor",
        flatten_with_keys=_with_keys(_jt_flatten, ("values", "weights", "lengths", "offsets")),
    )
    compat.register_pytree_node(
        KeyedJaggedTensor,
        _kjt_flatten,
        _kjt_unflatten,
        name="lightning_shardrec.KeyedJaggedTensor",
        flatten_with_keys=_with_keys(_kjt_flatten, _KJT_LEAVES),
    )
    compat.register_pytree_node(
        KeyedTensor,
        _kt_flatten,
        _kt_unflatten,
        name="lightning_shardrec.KeyedTensor",
        flatten_with_keys=_with_keys(_kt_flatten, ("values",)),
    )
    compat.register_flatten_spec(JaggedTensor, lambda jt, spec: _jt_flatten(jt)[0])
    compat.register_flatten_spec(KeyedJaggedTensor, lambda kjt, spec: _kjt_leaves(kjt))
    compat.register_flatten_spec(KeyedTensor, _kt_flatten_spec)
