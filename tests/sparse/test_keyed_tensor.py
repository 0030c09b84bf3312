"""``KeyedTensor``: pooled embeddings side by side, lookup and regrouping."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shardrec import KeyedTensor

PROPS = settings(max_examples=50, deadline=None)


@pytest.fixture
def kt() -> KeyedTensor:
    # B = 2; user has dim 2, item dim 3:  values [2, 5] = [ user | item ]
    return KeyedTensor(["user", "item"], [2, 3], torch.arange(10.0).view(2, 5))


def test_accessors(kt: KeyedTensor) -> None:
    assert kt.keys() == ["user", "item"]
    assert kt.length_per_key() == [2, 3]
    assert kt.offset_per_key() == [0, 2, 5]
    assert kt.key_dim() == 1
    assert kt.values().shape == (2, 5)


def test_positional_order_is_keys_lengths_values() -> None:
    values = torch.zeros(4, 3)
    kt = KeyedTensor(["a", "b"], [1, 2], values)
    assert kt.values() is values and kt.length_per_key() == [1, 2]


def test_getitem(kt: KeyedTensor) -> None:
    assert kt["user"].tolist() == [[0, 1], [5, 6]]
    assert kt["item"].tolist() == [[2, 3, 4], [7, 8, 9]]


def test_getitem_unknown_key(kt: KeyedTensor) -> None:
    with pytest.raises(KeyError, match=re.escape("key 'ad' not in KeyedTensor keys ['user', 'item']")):
        kt["ad"]


def test_to_dict(kt: KeyedTensor) -> None:
    d = kt.to_dict()
    assert list(d) == ["user", "item"]
    assert torch.equal(d["user"], kt["user"]) and torch.equal(d["item"], kt["item"])


def test_from_tensor_list() -> None:
    a, b = torch.ones(3, 2), torch.zeros(3, 4)
    kt = KeyedTensor.from_tensor_list(["a", "b"], [a, b])
    assert kt.length_per_key() == [2, 4]
    assert kt.values().shape == (3, 6)
    assert torch.equal(kt["a"], a) and torch.equal(kt["b"], b)


def test_key_dim_zero() -> None:
    kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(1, 3), torch.zeros(2, 3)], key_dim=0, cat_dim=0)
    assert kt.length_per_key() == [1, 2]
    assert kt["b"].tolist() == [[0, 0, 0], [0, 0, 0]]


def test_regroup_across_keyed_tensors(kt: KeyedTensor) -> None:
    other = KeyedTensor(["ad"], [1], torch.tensor([[-1.0], [-2.0]]))
    first, second = KeyedTensor.regroup([kt, other], [["item", "ad"], ["user"]])
    assert first.tolist() == [[2, 3, 4, -1], [7, 8, 9, -2]]
    assert torch.equal(second, kt["user"])


def test_regroup_as_dict(kt: KeyedTensor) -> None:
    out = KeyedTensor.regroup_as_dict([kt], [["item"], ["user", "item"]], ["g0", "g1"])
    assert list(out) == ["g0", "g1"]
    assert torch.equal(out["g0"], kt["item"])
    assert out["g1"].shape == (2, 5)
    assert out["g1"][:, 2:].tolist() == kt["item"].tolist()


def test_regroup_as_dict_group_key_count_mismatch(kt: KeyedTensor) -> None:
    with pytest.raises(ValueError, match="regroup_as_dict: 2 groups but 1 keys"):
        KeyedTensor.regroup_as_dict([kt], [["user"], ["item"]], ["only"])


def test_regroup_missing_key(kt: KeyedTensor) -> None:
    msg = re.escape("regroup: keys ['ad'] are in none of the KeyedTensors (have ['item', 'user'])")
    with pytest.raises(KeyError, match=msg):
        KeyedTensor.regroup([kt], [["user", "ad"]])


def test_regroup_needs_key_dim_1() -> None:
    kt = KeyedTensor(["a"], [2], torch.zeros(2, 3), key_dim=0)
    with pytest.raises(ValueError, match="KeyedTensor.regroup supports key_dim=1 only"):
        KeyedTensor.regroup([kt], [["a"]])


@PROPS
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(0, 3), st.data())
def test_regroup_matches_per_key_columns(dims: list[int], batch: int, data: st.DataObject) -> None:
    keys = [f"k{i}" for i in range(len(dims))]
    kt = KeyedTensor(keys, dims, torch.randn(batch, sum(dims)))
    groups = data.draw(st.lists(st.lists(st.sampled_from(keys), min_size=1, max_size=4), min_size=1, max_size=3))
    for group, out in zip(groups, KeyedTensor.regroup([kt], groups), strict=True):
        assert torch.equal(out, torch.cat([kt[k] for k in group], dim=1))
    assert torch.equal(KeyedTensor.regroup([kt], [keys])[0], kt.values())


def test_to_meta(kt: KeyedTensor) -> None:
    moved = kt.to("meta")
    assert isinstance(moved, KeyedTensor)
    assert moved.values().device.type == "meta" and moved.keys() == kt.keys()


def test_pickle_round_trip(kt: KeyedTensor) -> None:
    back = pickle.loads(pickle.dumps(kt))
    assert back.keys() == kt.keys() and torch.equal(back.values(), kt.values())


def test_repr(kt: KeyedTensor) -> None:
    assert repr(kt) == "KeyedTensor(keys=['user', 'item'], length_per_key=[2, 3], values=[2, 5])"


# --- bad input ---------------------------------------------------------------------------------
def test_key_and_length_counts_differ() -> None:
    with pytest.raises(ValueError, match="KeyedTensor: 2 keys but 1 lengths"):
        KeyedTensor(["a", "b"], [3], torch.zeros(2, 3))


def test_dims_do_not_match_values() -> None:
    msg = re.escape("KeyedTensor: length_per_key [2, 2] sums to 4 but values has shape (2, 5) (key_dim=1)")
    with pytest.raises(ValueError, match=msg):
        KeyedTensor(["a", "b"], [2, 2], torch.zeros(2, 5))


def test_values_without_key_dim() -> None:
    msg = re.escape("KeyedTensor: length_per_key [3] sums to 3 but values has shape (3,) (key_dim=1)")
    with pytest.raises(ValueError, match=msg):
        KeyedTensor(["a"], [3], torch.zeros(3))


def test_duplicate_keys() -> None:
    with pytest.raises(ValueError, match=re.escape("KeyedTensor keys must be unique, repeated: ['a']")):
        KeyedTensor(["a", "a"], [1, 1], torch.zeros(2, 2))
