"""TorchRec's helpers on the sparse types: ``jt_is_equal``, ``kjt_is_equal`` and ``regroup_kts``.

Equality compares what the objects hold, not identity: tensors by shape and ``torch.allclose``
(lengths and offsets computed where only one was given), a missing weight only equals a
missing weight; a KJT also compares its keys in order, per-key lengths/offsets and stride.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_shardrec._fbgemm import describe, fbgemm_available, fbgemm_ops_on
from lightning_shardrec.sparse.fx_proxy import _tracer_of

if TYPE_CHECKING:
    from lightning_shardrec.sparse.jagged_tensor import JaggedTensor
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
    from lightning_shardrec.sparse.keyed_tensor import KeyedTensor


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape:
            return False
        if a.dtype.is_floating_point != b.dtype.is_floating_point:
            return False
        return bool(torch.allclose(a, b.to(a.dtype)))
    return bool(a == b)


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """Whether two ``JaggedTensor`` hold the same values, weights, lengths and offsets."""
    from lightning_shardrec.sparse.jagged_tensor import JaggedTensor

    if (tracer := _tracer_of((jt_1, jt_2), {})) is not None:  # fx: one node (compares the run-time inputs)
        return tracer.create_proxy("call_function", jt_is_equal, (jt_1, jt_2), {})  # type: ignore[no-any-return]
    if not (isinstance(jt_1, JaggedTensor) and isinstance(jt_2, JaggedTensor)):
        return False
    pairs = [(j.values(), j.weights_or_none(), j.lengths(), j.offsets()) for j in (jt_1, jt_2)]
    return all(_same(a, b) for a, b in zip(*pairs, strict=True))


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """Whether two ``KeyedJaggedTensor`` hold the same keys (in order), values, weights, lengths, offsets and stride."""
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor

    if (tracer := _tracer_of((kjt_1, kjt_2), {})) is not None:  # fx: one node (compares the run-time inputs)
        return tracer.create_proxy("call_function", kjt_is_equal, (kjt_1, kjt_2), {})  # type: ignore[no-any-return]
    if not (isinstance(kjt_1, KeyedJaggedTensor) and isinstance(kjt_2, KeyedJaggedTensor)):
        return False
    if list(kjt_1.keys()) != list(kjt_2.keys()):
        return False
    pairs = [
        (k.values(), k.weights_or_none(), k.lengths(), k.offsets(), k.length_per_key(), k.offset_per_key(), k.stride())
        for k in (kjt_1, kjt_2)
    ]
    return all(_same(a, b) for a, b in zip(*pairs, strict=True))


def regroup_kts(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """TorchRec's function form of ``KeyedTensor.regroup``: one ``[B, sum of dims]`` tensor per group."""
    from lightning_shardrec.sparse.keyed_tensor import KeyedTensor

    return KeyedTensor.regroup(list(keyed_tensors), [list(g) for g in groups])


def _all_keys_used_once(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> bool:
    """Whether the groups name every key of the KeyedTensors exactly once (TorchRec's helper)."""
    keys = [k for kt in keyed_tensors for k in kt.keys()]  # noqa: SIM118 (a KeyedTensor, not a dict)
    grouped = [k for g in groups for k in g]
    return len(set(keys)) == len(set(grouped)) == len(keys) == len(grouped)


#: TorchRec's other paths to ``regroup_kts`` (its reference implementation, the fbgemm multi-permute op and the
#: pooled-embedding permute): one implementation here, the same results and gradients
_regroup_keyed_tensors = regroup_kts
permute_multi_embedding = regroup_kts
_fbgemm_permute_pooled_embs = regroup_kts


def _kt_regroup_arguments(
    value: Tensor, keys: list[list[str]], key_lengths: list[list[int]], groups: list[list[str]]
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """TorchRec's argument builder for fbgemm's ``permute_multi_embedding`` op: ``(permutes, in_shapes,
    out_shapes, out_lengths)``, computed by fbgemm's own ``kt_regroup_arguments`` operator (the same arguments
    and results). Where fbgemm's operators do not run for ``value``'s device it is refused by name."""
    device = value.device.type
    if not (fbgemm_available() and (device in ("cpu", "meta") or fbgemm_ops_on(device))):
        raise NotImplementedError(
            "lightning_shardrec.sparse.jagged_tensor._kt_regroup_arguments (TorchRec's index tensors for fbgemm's "
            f"permute_multi_embedding op) needs fbgemm's operators on {device}, and they do not run here "
            f"({describe()}): regroup KeyedTensors with regroup_kts or KeyedTensor.regroup. "
            "See docs/migrating.md, 'Sparse types'"
        )
    return torch.ops.fbgemm.kt_regroup_arguments(value, keys, key_lengths, groups)  # type: ignore[no-any-return]


__all__ = ["_all_keys_used_once", "jt_is_equal", "kjt_is_equal", "regroup_kts"]
