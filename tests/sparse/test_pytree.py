"""The sparse types are pytree nodes with TorchRec's leaves (torch.export / tree_map see their tensors)."""

from __future__ import annotations

import pytest
import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from lightning_shardrec import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from lightning_shardrec.sparse import pytree as sparse_pytree

T = torch.tensor


def test_kjt_round_trip_keeps_vbe_and_inverse_indices() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        T([1, 2, 3]),
        T([0.5, 1.0, 1.5]),
        offsets=T([0, 2, 2, 3]),
        stride_per_key_per_rank=[[2], [1]],
        inverse_indices=(["a", "b"], T([[0, 1], [0, 0]])),
    )
    leaves, spec = pytree.tree_flatten(kjt)
    assert len(leaves) == 6 and torch.equal(leaves[0], kjt.values())
    out = pytree.tree_unflatten(leaves, spec)
    assert out.keys() == ["a", "b"] and out.lengths_or_none() is None
    assert out.stride_per_key_per_rank() == [[2], [1]]
    assert torch.equal(out.inverse_indices()[1], kjt.inverse_indices()[1])
    assert [b.tolist() for b in out["a"].to_dense()] == [[1, 2], []]


def test_kjt_fewer_leaves_mean_none_more_raise() -> None:
    kjt = KeyedJaggedTensor(["a"], T([1, 2]), lengths=T([2]))
    leaves, spec = pytree.tree_flatten(kjt)
    short = pytree.TreeSpec(spec.type, spec.context, spec.children_specs[:4])
    out = pytree.tree_unflatten(leaves[:4], short)
    assert out.stride_per_key_per_rank() == [] and out.inverse_indices_or_none() is None
    with pytest.raises(ValueError):
        pytree.tree_unflatten(leaves + leaves, spec)
    with pytest.raises(ValueError, match=r"KeyedJaggedTensor takes at most 6 pytree leaves .* got 12"):
        sparse_pytree._kjt_unflatten(leaves + leaves, spec.context)


def test_tree_map_moves_every_tensor() -> None:
    kjt = KeyedJaggedTensor(["a"], T([1, 2]), T([1.0, 2.0]), lengths=T([2]))
    out = pytree.tree_map(lambda t: None if t is None else t.to("meta"), {"batch": kjt})  # absent fields are None
    assert out["batch"].values().device.type == "meta" and out["batch"].weights().device.type == "meta"


def test_jt_round_trip() -> None:
    jt = JaggedTensor(T([1.0, 2.0, 3.0]), lengths=T([1, 0, 2]))
    leaves, spec = pytree.tree_flatten(jt)
    assert len(leaves) == 4
    out = pytree.tree_unflatten(leaves, spec)
    assert torch.equal(out.lengths(), jt.lengths()) and out.weights_or_none() is None


def test_kt_round_trip_and_flatten_spec_reorders_keys() -> None:
    kt = KeyedTensor.from_tensor_list(["x", "y"], [T([[1.0], [2.0]]), T([[3.0, 4.0], [5.0, 6.0]])])
    leaves, spec = pytree.tree_flatten(kt)
    assert len(leaves) == 1 and torch.equal(leaves[0], kt.values())
    out = pytree.tree_unflatten(leaves, spec)
    assert out.keys() == ["x", "y"] and out.length_per_key() == [1, 2]
    swapped = KeyedTensor.from_tensor_list(["y", "x"], [kt["y"], kt["x"]])
    again = pytree.tree_unflatten(fx_pytree.tree_flatten_spec(swapped, spec), spec)
    assert again.keys() == ["x", "y"]
    torch.testing.assert_close(again["y"], kt["y"])
