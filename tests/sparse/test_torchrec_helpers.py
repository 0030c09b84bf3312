"""TorchRec's helpers at ``sparse.jagged_tensor``: equality, ``regroup_kts`` and the dict conversion modules."""

from __future__ import annotations

import torch

from lightning_shardrec.sparse.jagged_tensor import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    jt_is_equal,
    kjt_is_equal,
    regroup_kts,
)

T = torch.tensor


def test_jt_is_equal_compares_what_is_held() -> None:
    a = JaggedTensor(T([1.0, 2.0, 3.0]), lengths=T([2, 1]))
    assert jt_is_equal(a, JaggedTensor(T([1.0, 2.0, 3.0]), offsets=T([0, 2, 3])))  # offsets given, lengths computed
    assert not jt_is_equal(a, JaggedTensor(T([1.0, 2.0, 3.0]), lengths=T([1, 2])))
    assert not jt_is_equal(a, JaggedTensor(T([1.0, 2.0, 4.0]), lengths=T([2, 1])))
    assert not jt_is_equal(a, JaggedTensor(T([1.0, 2.0, 3.0]), T([1.0, 1.0, 1.0]), lengths=T([2, 1])))  # weights
    assert not jt_is_equal(a, "not a jagged tensor")  # type: ignore[arg-type]


def test_kjt_is_equal_compares_keys_in_order_and_tensors() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([2, 0, 1, 0]))
    assert kjt_is_equal(kjt, KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), offsets=T([0, 2, 2, 3, 3])))
    assert not kjt_is_equal(kjt, KeyedJaggedTensor(["b", "a"], T([1, 2, 3]), lengths=T([2, 0, 1, 0])))
    assert not kjt_is_equal(kjt, KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([1, 1, 1, 0])))
    assert not kjt_is_equal(kjt, KeyedJaggedTensor(["a"], T([1, 2, 3]), lengths=T([2, 1])))


def test_regroup_kts_is_keyed_tensor_regroup() -> None:
    kt1 = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 1), 2 * torch.ones(2, 2)])
    kt2 = KeyedTensor.from_tensor_list(["z"], [3 * torch.ones(2, 1)])
    got = regroup_kts([kt1, kt2], [["z", "x"], ["y"]])
    assert [g.tolist() for g in got] == [[[3.0, 1.0]] * 2, [[2.0, 2.0]] * 2]


def test_dict_conversion_modules_round_trip() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], T([1, 2, 3, 4]), T([0.5, 1.0, 1.5, 2.0]), lengths=T([2, 0, 1, 1]))
    jts = ComputeKJTToJTDict()(kjt)
    assert list(jts) == ["a", "b"] and jts["b"].values().tolist() == [3, 4]
    assert kjt_is_equal(ComputeJTDictToKJT()(jts), kjt)
