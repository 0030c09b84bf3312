"""A KJT is a general jagged container, as in TorchRec: float and ``[N, D]`` values,
values longer than the bags, any weights dtype, empty and 2-D lengths, the meta device."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_shardrec import JaggedTensor, KeyedJaggedTensor

T = torch.tensor


def test_float_values() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], T([1.0, 2.0, 3.0, 4.0]), offsets=T([0, 2, 2, 3, 4], dtype=torch.int32))
    assert kjt["a"].values().tolist() == [1.0, 2.0] and kjt["b"].lengths().tolist() == [1, 1]
    assert kjt.permute([1, 0]).values().tolist() == [3.0, 4.0, 1.0, 2.0]
    assert [s.values().tolist() for s in kjt.split([1, 1])] == [[1.0, 2.0], [3.0, 4.0]]


def test_2d_values_are_rows_per_value() -> None:
    values = torch.arange(12, dtype=torch.float32).view(4, 3)
    kjt = KeyedJaggedTensor.from_offsets_sync(["a", "b"], values, T([0, 2, 2, 3, 4]), weights=torch.ones(4))
    torch.testing.assert_close(kjt["a"].values(), values[:2])
    torch.testing.assert_close(kjt.permute([1, 0]).values(), values[[2, 3, 0, 1]])
    assert kjt.length_per_key() == [2, 2]


def test_values_and_weights_longer_than_the_bags() -> None:
    """The tail past ``sum(lengths)`` is in no bag: lookups, permute, split, concat ignore it."""
    kjt = KeyedJaggedTensor(["a", "b"], T([1, 2, 3, 90, 91]), torch.arange(10.0), T([2, 0, 1, 0]))
    assert kjt.length_per_key() == [2, 1] and kjt.offset_per_key() == [0, 2, 3]
    assert kjt["b"].values().tolist() == [3] and kjt["b"].weights().tolist() == [2.0]
    permuted = kjt.permute([1, 0])
    assert permuted.values().tolist() == [3, 1, 2] and permuted.weights().tolist() == [2.0, 0.0, 1.0]
    assert KeyedJaggedTensor.concat([kjt, kjt.permute([])]).values().tolist() == [1, 2, 3]
    kjt.validate()


def test_integer_weights_are_kept() -> None:
    """TorchRec carries e.g. bucketization positions as long weights."""
    kjt = KeyedJaggedTensor(["a"], T([5, 6]), T([0, 1]), T([2]))
    assert kjt.weights().dtype == torch.int64 and kjt["a"].weights().tolist() == [0, 1]


def test_empty_float_lengths_and_no_keys() -> None:
    """``torch.tensor([])`` lengths/offsets (float) of no bags are accepted, as int32."""
    kjt = KeyedJaggedTensor(["a"], T([]), lengths=T([]))
    assert kjt.lengths().dtype == torch.int32 and kjt["a"].values().numel() == 0
    by_offsets = KeyedJaggedTensor(["b"], T([]), offsets=T([]))
    assert by_offsets["b"].lengths().numel() == 0
    both = KeyedJaggedTensor.concat([kjt, by_offsets])
    assert both.keys() == ["a", "b"] and both["b"].values().numel() == 0
    nothing = KeyedJaggedTensor([], torch.empty(0))  # no keys: no lengths needed
    assert nothing.keys() == [] and nothing.stride() == 0 and nothing.to_dict() == {}


def test_2d_lengths_are_flattened_key_major() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], T([1, 2, 3]), lengths=T([[1, 0], [1, 1]]))
    assert kjt.lengths().tolist() == [1, 0, 1, 1] and kjt.stride() == 2
    empty = KeyedJaggedTensor.from_lengths_sync(["a", "b"], T([]), T([[], []]))
    jts = empty.to_dict()
    assert jts["a"].lengths().numel() == 0 and jts["a"].offsets().numel() == 0  # as TorchRec: no bags, no offsets


def test_float_lengths_raise_assertion_error_as_torchrec() -> None:
    values = torch.rand(7, 3)
    with pytest.raises(AssertionError, match="lengths must be an integer tensor, got dtype torch.float64"):
        KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], values, T([3, 4], dtype=torch.float64))
    with pytest.raises(AssertionError, match="offsets must be an integer tensor, got dtype torch.float64"):
        KeyedJaggedTensor.from_offsets_sync(["f1", "f2"], values, T([0, 3, 7], dtype=torch.float64))


def test_weights_missing_raises_assertion_error_as_torchrec() -> None:
    kjt = KeyedJaggedTensor(["a"], T([1]), lengths=T([1]))
    with pytest.raises(AssertionError, match=re.escape("KeyedJaggedTensor(keys=['a']) has no weights")):
        kjt.weights()


def test_concat_stride_mismatch_raises_assertion_error_as_torchrec() -> None:
    a = KeyedJaggedTensor(["a"], T([1]), lengths=T([1]))
    b = KeyedJaggedTensor(["b"], T([1]), lengths=T([1, 0]))
    with pytest.raises(
        AssertionError, match=re.escape("KeyedJaggedTensor.concat needs one batch size, got strides [1, 2]")
    ):
        KeyedJaggedTensor.concat([a, b])


def test_needs_lengths_when_there_are_keys() -> None:
    with pytest.raises(AssertionError, match=re.escape("KeyedJaggedTensor(keys=['a']) needs lengths or offsets")):
        KeyedJaggedTensor(["a"], T([1]))


# --- meta device ---------------------------------------------------------------------------------
def meta(*data: list, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [torch.tensor(d, dtype=dtype, device="meta") for d in data]


def test_meta_sync_length_per_key_and_constructors() -> None:
    """No data on meta: per-key counts split the values evenly (the remainder to key 0), as TorchRec."""
    keys = ["a", "b", "c", "d"]
    lengths, offsets = meta([2, 0, 1, 1, 1, 3, 0, 2], [0, 2, 2, 3, 4, 5, 8, 8, 10])
    values, weights = meta([float(i) for i in range(10)], [1.0] * 10)
    kjt = KeyedJaggedTensor(keys, values, weights, lengths)
    assert kjt.stride() == 2
    kjt.sync()
    assert kjt.length_per_key() == [4, 2, 2, 2] and kjt.offset_per_key() == [0, 4, 6, 8, 10]
    assert kjt.unsync().length_per_key_or_none() is None and kjt.offset_per_key_or_none() is None
    jts = kjt.to_dict()
    assert jts["a"].values().device.type == "meta" and jts["a"].lengths().shape == (2,)
    again = KeyedJaggedTensor.from_jt_dict(jts)
    assert again.keys() == keys and again.values().shape == (10,)
    assert KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights).length_per_key() == [4, 2, 2, 2]
    assert KeyedJaggedTensor.from_offsets_sync(keys, values, offsets, weights).stride() == 2
    empty = KeyedJaggedTensor.from_lengths_sync([], *meta([], []))
    assert empty.keys() == [] and empty.length_per_key() == []


def test_meta_permute_and_split() -> None:
    lengths = torch.tensor([1, 1, 2, 0], device="meta")
    kjt = KeyedJaggedTensor(["a", "b"], torch.zeros(4, dtype=torch.int64, device="meta"), lengths=lengths)
    assert kjt.permute([1, 0]).keys() == ["b", "a"]
    assert [s.keys() for s in kjt.split([1, 1])] == [["a"], ["b"]]


def test_jagged_tensor_general_values() -> None:
    jt = JaggedTensor(torch.arange(6.0).view(3, 2), offsets=T([0, 2, 2, 3], dtype=torch.int32))
    assert jt.lengths().tolist() == [2, 0, 1]
    assert [b.shape for b in jt.to_dense()] == [(2, 2), (0, 2), (1, 2)]


# --- caller-given per-key totals and 0-d weights ---------------------------------------------------
def test_length_and_offset_per_key_must_fit_the_values() -> None:
    values, lengths = T([1, 2, 3]), T([1, 2])
    on_meta = values.to("meta"), lengths.to("meta")  # no data to compare: the counts alone are checked
    with pytest.raises(ValueError, match=re.escape("length_per_key [1] needs one count >= 0 per key (2)")):
        KeyedJaggedTensor(["a", "b"], on_meta[0], lengths=on_meta[1], length_per_key=[1])
    with pytest.raises(ValueError, match=re.escape("length_per_key [1, 2] but the lengths give [1, 1]")):
        KeyedJaggedTensor(["a", "b"], values, lengths=T([1, 1]), length_per_key=[1, 2])
    msg = "offset_per_key [0, 2] needs 3 non-decreasing entries from 0 to at most 3"
    with pytest.raises(ValueError, match=re.escape(msg)):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, offset_per_key=[0, 2])
    msg = "offset_per_key [0, 2, 3] disagrees with length_per_key [1, 2]"
    with pytest.raises(ValueError, match=re.escape(msg)):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, length_per_key=[1, 2], offset_per_key=[0, 2, 3])
    ok = KeyedJaggedTensor(
        ["a", "b"], T([1, 2, 3, 9]), lengths=lengths, length_per_key=[1, 2], offset_per_key=[0, 1, 3]
    )
    assert ok.offset_per_key() == [0, 1, 3]  # values may run past the last bag


def test_0d_weights_rejected() -> None:
    with pytest.raises(
        ValueError, match=re.escape("KeyedJaggedTensor(keys=['a']): weights must have one entry per value")
    ):
        KeyedJaggedTensor(["a"], T([1]), T(1.0), T([1]))
