"""``KeyedJaggedTensor``: TorchRec's tutorial example, every method, round-trip
properties, Lightning transfer, pickling and the validation messages."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_shardrec import JaggedTensor, KeyedJaggedTensor

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory/record_stream need CUDA")
PROPS = settings(max_examples=50, deadline=None)


def bags(jt: JaggedTensor) -> list[list[int]]:
    return [b.tolist() for b in jt.to_dense()]


@pytest.fixture
def kjt() -> KeyedJaggedTensor:
    """TorchRec's tutorial KJT: product=[[1, 2], [], [3]], user=[[4], [5], [6]]."""
    return KeyedJaggedTensor(
        keys=["product", "user"],
        values=torch.tensor([1, 2, 3, 4, 5, 6]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 1], dtype=torch.int64),
    )


@pytest.fixture
def weighted() -> KeyedJaggedTensor:
    # a=[[1], [2, 3]]  b=[[], [4]]  c=[[5, 6], []]
    return KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.tensor([1, 2, 3, 4, 5, 6]),
        torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
        torch.tensor([1, 2, 0, 1, 2, 0]),
    )


# --- the TorchRec tutorial example ---------------------------------------------------------
def test_tutorial_example_per_key_jagged_tensors(kjt: KeyedJaggedTensor) -> None:
    jts = kjt.to_dict()
    assert list(jts) == ["product", "user"]
    assert bags(jts["product"]) == [[1, 2], [], [3]]
    assert bags(jts["user"]) == [[4], [5], [6]]
    assert jts["product"].lengths().tolist() == [2, 0, 1]
    assert jts["user"].offsets().tolist() == [0, 1, 2, 3]


def test_accessors(kjt: KeyedJaggedTensor) -> None:
    assert kjt.keys() == ["product", "user"]
    assert kjt.values().tolist() == [1, 2, 3, 4, 5, 6]
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 1]
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 5, 6]
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [3, 3]
    assert kjt.offset_per_key() == [0, 3, 6]
    assert kjt.weights_or_none() is None
    assert kjt.device().type == "cpu"


def test_getitem(kjt: KeyedJaggedTensor) -> None:
    user = kjt["user"]
    assert isinstance(user, JaggedTensor)
    assert user.values().tolist() == [4, 5, 6]
    assert user.lengths().tolist() == [1, 1, 1]
    assert user.weights_or_none() is None


def test_getitem_unknown_key_lists_keys(kjt: KeyedJaggedTensor) -> None:
    with pytest.raises(KeyError, match=re.escape("key 'item' not in KeyedJaggedTensor keys ['product', 'user']")):
        kjt["item"]


def test_weights_follow_their_key(weighted: KeyedJaggedTensor) -> None:
    torch.testing.assert_close(weighted["c"].weights(), torch.tensor([0.5, 0.6]))
    assert weighted["b"].values().tolist() == [4]
    assert weighted.length_per_key() == [3, 1, 2]


def test_weights_raises_when_unweighted(kjt: KeyedJaggedTensor) -> None:
    msg = re.escape("KeyedJaggedTensor(keys=['product', 'user']) has no weights; use weights_or_none()")
    with pytest.raises(ValueError, match=msg):
        kjt.weights()


def test_positional_order_matches_torchrec() -> None:
    # TorchRec: KeyedJaggedTensor(keys, values, weights, lengths, offsets, stride)
    values, weights, lengths = (
        torch.tensor([7, 8]),
        torch.tensor([0.5, 2.0]),
        torch.tensor([1, 0, 1, 0]),
    )
    kjt = KeyedJaggedTensor(["a", "b"], values, weights, lengths)
    assert kjt.weights() is weights
    assert kjt.lengths() is lengths
    assert kjt.stride() == 2
    by_offsets = KeyedJaggedTensor(["a", "b"], values, None, None, torch.tensor([0, 1, 1, 2, 2]), 2)
    assert by_offsets.lengths().tolist() == [1, 0, 1, 0]


def test_explicit_stride() -> None:
    kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]), stride=4)
    assert kjt.stride() == 4


# --- alternative constructors --------------------------------------------------------------
def test_from_lengths_sync(kjt: KeyedJaggedTensor) -> None:
    out = KeyedJaggedTensor.from_lengths_sync(["product", "user"], kjt.values(), kjt.lengths())
    assert out.length_per_key() == [3, 3]
    assert out.offsets().tolist() == kjt.offsets().tolist()


def test_from_offsets_sync(kjt: KeyedJaggedTensor) -> None:
    weights = torch.arange(6.0)
    out = KeyedJaggedTensor.from_offsets_sync(["product", "user"], kjt.values(), kjt.offsets(), weights)
    assert out.lengths().tolist() == [2, 0, 1, 1, 1, 1]
    assert out.length_per_key() == [3, 3]
    assert out.weights() is weights
    assert bags(out["product"]) == [[1, 2], [], [3]]


def test_from_jt_dict_round_trip(weighted: KeyedJaggedTensor) -> None:
    back = KeyedJaggedTensor.from_jt_dict(weighted.to_dict())
    assert back.keys() == weighted.keys()
    assert torch.equal(back.values(), weighted.values())
    assert torch.equal(back.lengths(), weighted.lengths())
    assert torch.equal(back.weights(), weighted.weights())
    assert back.stride() == 2


def test_from_jt_dict_empty_dict_is_empty_kjt() -> None:
    assert KeyedJaggedTensor.from_jt_dict({}).keys() == []


def test_from_jt_dict_batch_sizes_differ_gives_variable_batch() -> None:
    """As TorchRec: per-key batch sizes that differ become ``stride_per_key_per_rank``."""
    jts = {
        "a": JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1, 0])),
        "b": JaggedTensor(torch.tensor([2]), lengths=torch.tensor([1])),
    }
    kjt = KeyedJaggedTensor.from_jt_dict(jts)
    assert kjt.variable_stride_per_key()
    assert kjt.stride_per_key_per_rank() == [[2], [1]]
    assert kjt.stride_per_key() == [2, 1] and kjt.stride() == 2
    assert bags(kjt["a"]) == [[1], []] and bags(kjt["b"]) == [[2]]


def test_from_jt_dict_mixed_weights() -> None:
    jts = {
        "a": JaggedTensor(torch.tensor([1]), torch.tensor([1.0]), torch.tensor([1])),
        "b": JaggedTensor(torch.tensor([2]), lengths=torch.tensor([1])),
    }
    with pytest.raises(ValueError, match=re.escape("from_jt_dict: keys ['b'] have no weights while others do")):
        KeyedJaggedTensor.from_jt_dict(jts)


def test_empty() -> None:
    kjt = KeyedJaggedTensor.empty()
    assert kjt.keys() == [] and kjt.stride() == 0
    assert kjt.values().numel() == 0 and kjt.values().dtype == torch.int64
    assert kjt.length_per_key() == [] and kjt.offset_per_key() == [0]
    assert kjt.weights_or_none() is None
    assert KeyedJaggedTensor.empty(is_weighted=True).weights().numel() == 0
    assert KeyedJaggedTensor.empty(device="meta").device().type == "meta"


# --- concat ------------------------------------------------------------------------------
def test_concat(kjt: KeyedJaggedTensor) -> None:
    other = KeyedJaggedTensor(["item"], torch.tensor([9, 9]), lengths=torch.tensor([0, 2, 0]))
    out = KeyedJaggedTensor.concat([kjt, other])
    assert out.keys() == ["product", "user", "item"]
    assert out.values().tolist() == [1, 2, 3, 4, 5, 6, 9, 9]
    assert out.lengths().tolist() == [2, 0, 1, 1, 1, 1, 0, 2, 0]
    assert out.stride() == 3
    assert out.length_per_key() == [3, 3, 2]
    assert bags(out["item"]) == [[], [9, 9], []]


def test_concat_with_keyless_kjt(weighted: KeyedJaggedTensor) -> None:
    # regression: an (unweighted) empty KJT beside weighted ones used to raise "has no weights"
    out = KeyedJaggedTensor.concat([weighted, KeyedJaggedTensor.empty()])
    assert out.keys() == ["a", "b", "c"]
    assert torch.equal(out.weights(), weighted.weights())
    assert out.stride() == 2


def test_concat_needs_at_least_one() -> None:
    with pytest.raises(ValueError, match="KeyedJaggedTensor.concat needs at least one KJT"):
        KeyedJaggedTensor.concat([])


def test_concat_stride_mismatch(kjt: KeyedJaggedTensor, weighted: KeyedJaggedTensor) -> None:
    unweighted = KeyedJaggedTensor(["x"], torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(
        ValueError,
        match=re.escape("KeyedJaggedTensor.concat needs one batch size, got strides [2, 3]"),
    ):
        KeyedJaggedTensor.concat([kjt, unweighted])


def test_concat_weighted_with_unweighted(weighted: KeyedJaggedTensor) -> None:
    unweighted = KeyedJaggedTensor(["x"], torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="KeyedJaggedTensor.concat cannot mix weighted and unweighted KJTs"):
        KeyedJaggedTensor.concat([weighted, unweighted])


# --- split -------------------------------------------------------------------------------
def test_split(weighted: KeyedJaggedTensor) -> None:
    first, rest = weighted.split([1, 2])
    assert first.keys() == ["a"] and rest.keys() == ["b", "c"]
    assert first.values().tolist() == [1, 2, 3]
    assert rest.lengths().tolist() == [0, 1, 2, 0]
    torch.testing.assert_close(rest.weights(), torch.tensor([0.4, 0.5, 0.6]))
    assert rest.length_per_key() == [1, 2]
    assert rest.offsets().tolist() == [0, 0, 1, 3, 3]
    assert first.stride() == rest.stride() == 2


def test_split_with_empty_segments(kjt: KeyedJaggedTensor) -> None:
    left, middle, right = kjt.split([0, 2, 0])
    assert left.keys() == [] and right.keys() == []
    assert left.values().numel() == 0 and right.lengths().numel() == 0
    assert left.stride() == 3  # TorchRec keeps the batch size on empty pieces
    assert middle.keys() == kjt.keys() and torch.equal(middle.values(), kjt.values())


@pytest.mark.parametrize("segments", [[1], [1, 2], [3, -1]])
def test_split_segments_wrong(kjt: KeyedJaggedTensor, segments: list[int]) -> None:
    msg = re.escape(f"split segments {segments} must be non-negative and sum to 2 keys")
    with pytest.raises(ValueError, match=msg):
        kjt.split(segments)


# --- permute -----------------------------------------------------------------------------
def test_permute_reorders(kjt: KeyedJaggedTensor) -> None:
    out = kjt.permute([1, 0])
    assert out.keys() == ["user", "product"]
    assert out.values().tolist() == [4, 5, 6, 1, 2, 3]
    assert out.lengths().tolist() == [1, 1, 1, 2, 0, 1]
    assert out.length_per_key() == [3, 3]
    assert bags(out["product"]) == [[1, 2], [], [3]]


def test_permute_repeats_and_drops_keys(weighted: KeyedJaggedTensor) -> None:
    out = weighted.permute([2, 0, 2])  # c, a, c  (b dropped)
    assert out.keys() == ["c", "a", "c"]
    assert out.values().tolist() == [5, 6, 1, 2, 3, 5, 6]
    assert out.lengths().tolist() == [2, 0, 1, 2, 2, 0]
    torch.testing.assert_close(out.weights(), torch.tensor([0.5, 0.6, 0.1, 0.2, 0.3, 0.5, 0.6]))
    assert out.length_per_key() == [2, 3, 2]
    assert out.stride() == 2


def test_permute_with_indices_tensor(kjt: KeyedJaggedTensor) -> None:
    out = kjt.permute([1], torch.tensor([1]))
    assert out.keys() == ["user"] and out.values().tolist() == [4, 5, 6]


@pytest.mark.parametrize(("indices", "bad"), [([0, 2], [2]), ([-1, 0], [-1])])
def test_permute_out_of_range(kjt: KeyedJaggedTensor, indices: list[int], bad: list[int]) -> None:
    msg = re.escape(f"permute indices {bad} outside [0, 2) for keys ['product', 'user']")
    with pytest.raises(ValueError, match=msg):
        kjt.permute(indices)


# --- movement, pickling, repr --------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_to(weighted: KeyedJaggedTensor, device: str) -> None:
    weighted.offsets()
    moved = weighted.to(device)
    assert isinstance(moved, KeyedJaggedTensor)
    for t in (moved.values(), moved.weights(), moved.lengths(), moved.offsets()):
        assert t.device.type == device
    assert moved.keys() == weighted.keys() and moved.stride() == 2
    assert moved.values().shape == weighted.values().shape


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_move_data_to_device_inside_a_tuple(kjt: KeyedJaggedTensor, device: str) -> None:
    labels = torch.tensor([0.0, 1.0, 1.0])
    moved_kjt, moved_labels = move_data_to_device((kjt, labels), device)
    assert isinstance(moved_kjt, KeyedJaggedTensor)
    assert moved_kjt.device().type == device and moved_kjt.lengths().device.type == device
    assert moved_labels.device.type == device
    assert moved_kjt.keys() == ["product", "user"]
    assert moved_kjt.values().shape == (6,)
    if device == "cpu":
        assert bags(moved_kjt["user"]) == [[4], [5], [6]]


@needs_cuda
def test_pin_memory(weighted: KeyedJaggedTensor) -> None:
    pinned = weighted.pin_memory()
    assert pinned.values().is_pinned() and pinned.weights().is_pinned() and pinned.lengths().is_pinned()
    assert pinned.values().tolist() == weighted.values().tolist()


@needs_cuda
def test_record_stream(weighted: KeyedJaggedTensor) -> None:
    weighted.to("cuda").record_stream(torch.cuda.current_stream())  # must not raise


def test_pickle_round_trip(weighted: KeyedJaggedTensor) -> None:
    weighted.offset_per_key()  # cached metadata survives too
    back = pickle.loads(pickle.dumps(weighted))
    assert isinstance(back, KeyedJaggedTensor)
    assert back.keys() == ["a", "b", "c"]
    assert torch.equal(back.values(), weighted.values())
    assert torch.equal(back.lengths(), weighted.lengths())
    assert torch.equal(back.weights(), weighted.weights())
    assert back.stride() == 2 and back.offset_per_key() == [0, 3, 4, 6]
    assert bags(back["a"]) == [[1], [2, 3]]


def test_repr_shows_keys_and_bags(weighted: KeyedJaggedTensor) -> None:
    text = repr(weighted)
    assert text.splitlines()[0] == "KeyedJaggedTensor(stride=2, keys=['a', 'b', 'c'])"
    assert "'a': [[1], [2, 3]]" in text
    assert "'b': [[], [4]]" in text
    assert "weights=" in text


def test_repr_of_empty_and_meta(kjt: KeyedJaggedTensor) -> None:
    assert repr(KeyedJaggedTensor.empty()) == "KeyedJaggedTensor(keys=[], stride=0)"
    assert repr(kjt.split([0, 2])[0]) == "KeyedJaggedTensor(keys=[], stride=3)"
    assert "keys=['product', 'user']" in repr(kjt.to("meta"))  # no data to read, must not raise


# --- bad input: construction ------------------------------------------------------------------
def test_needs_lengths_or_offsets() -> None:
    msg = re.escape("KeyedJaggedTensor(keys=['a']) needs lengths or offsets (got neither)")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a"], torch.tensor([1]))


def test_key_count_does_not_divide_lengths() -> None:
    msg = re.escape("3 lengths do not divide into 2 keys ['a', 'b']")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))


def test_no_keys_but_lengths() -> None:
    with pytest.raises(ValueError, match="KeyedJaggedTensor has no keys but 2 lengths"):
        KeyedJaggedTensor([], torch.tensor([1]), lengths=torch.tensor([1, 0]))


def test_stride_mismatch() -> None:
    msg = re.escape("stride 3 x 2 keys ['a', 'b'] needs 6 lengths, got 4")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]), stride=3)


def test_weights_of_wrong_size() -> None:
    msg = re.escape("KeyedJaggedTensor(keys=['a']): 1 weights for 2 values (need one per value)")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([1.0]), torch.tensor([2]))


def test_lengths_sum_more_than_values() -> None:
    msg = re.escape("KeyedJaggedTensor(keys=['a', 'b']): lengths sum to 4 but there are 3 values")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 2]))


def test_offsets_span_more_than_values() -> None:
    msg = re.escape("KeyedJaggedTensor(keys=['a']): offsets span 4 values but there are 3")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 4]))


def test_lengths_and_offsets_counts_disagree() -> None:
    msg = re.escape("3 offsets disagree with 1 lengths (offsets need len(lengths) + 1 = 2)")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a"], torch.tensor([1]), lengths=torch.tensor([1]), offsets=torch.tensor([0, 1, 1]))


def test_duplicate_keys() -> None:
    msg = re.escape("KeyedJaggedTensor keys must be unique, repeated: ['a']")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["a", "b", "a"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))


def test_float_lengths_rejected() -> None:
    with pytest.raises(ValueError, match="lengths must be an integer tensor, got dtype torch.float32"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([1.0, 1.0]))


# --- bad input: validate() -----------------------------------------------------------------
def test_validate_accepts_good_data(kjt: KeyedJaggedTensor, weighted: KeyedJaggedTensor) -> None:
    kjt.validate()
    weighted.validate()


def test_negative_length_names_key_at_construction_and_in_validate() -> None:
    # lengths sum to 3 = number of values; on CPU the constructor checks the data, and
    # validate() re-checks it after in-place edits (it is the only check for device tensors)
    msg = re.escape("negative length -1 at key 'user' (bag 0 of 3); lengths must be >= 0")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(["product", "user"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 0, -1, 1, 1]))
    kjt = KeyedJaggedTensor(["product", "user"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 0, 0, 1, 0]))
    kjt.lengths()[:] = torch.tensor([1, 1, 0, -1, 1, 1])
    with pytest.raises(ValueError, match=msg):
        kjt.validate()


def test_offsets_disagree_with_lengths_names_key() -> None:
    msg = re.escape("offsets disagree with lengths at key 'b' (bag 0 of 2): offsets give 2, lengths give 1")
    with pytest.raises(ValueError, match=msg):
        KeyedJaggedTensor(
            ["a", "b"],
            torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 0, 1, 1]),
            offsets=torch.tensor([0, 1, 1, 3, 3]),
        )
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]), offsets=torch.tensor([0, 1, 1, 3, 3])
    )
    kjt.lengths()[:] = torch.tensor([1, 0, 1, 1])
    with pytest.raises(ValueError, match=msg):
        kjt.validate()


def test_offsets_only_must_start_at_zero() -> None:
    with pytest.raises(ValueError, match="offsets must start at 0, got 1"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), offsets=torch.tensor([1, 2, 2, 3, 4]))
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 1, 1, 2, 3]))
    kjt.offsets()[:] = torch.tensor([1, 2, 2, 3, 4])
    with pytest.raises(ValueError, match="offsets must start at 0, got 1"):
        kjt.validate()


# --- properties ------------------------------------------------------------------------------
@st.composite
def kjts(draw: st.DrawFn) -> KeyedJaggedTensor:
    num_keys = draw(st.integers(1, 5))
    batch = draw(st.integers(0, 4))
    lengths = draw(st.lists(st.integers(0, 4), min_size=num_keys * batch, max_size=num_keys * batch))
    total = sum(lengths)
    values = draw(st.lists(st.integers(0, 10**9), min_size=total, max_size=total))
    weights = None
    if draw(st.booleans()):
        weights = torch.tensor(draw(st.lists(st.floats(-1, 1, width=32), min_size=total, max_size=total)))
    return KeyedJaggedTensor(
        [f"f{i}" for i in range(num_keys)],
        torch.tensor(values, dtype=torch.int64),
        None if weights is None else weights.float(),
        torch.tensor(lengths, dtype=torch.int64),
        stride=batch,
    )


def assert_same(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> None:
    assert a.keys() == b.keys()
    assert a.stride() == b.stride()
    assert torch.equal(a.values(), b.values())
    assert torch.equal(a.lengths(), b.lengths())
    assert torch.equal(a.offsets(), b.offsets())
    assert a.length_per_key() == b.length_per_key()
    wa, wb = a.weights_or_none(), b.weights_or_none()
    assert (wa is None) == (wb is None)
    if wa is not None and wb is not None:
        assert torch.equal(wa, wb)


@PROPS
@given(kjts(), st.randoms(use_true_random=False))
def test_permute_then_inverse_is_identity(kjt: KeyedJaggedTensor, rnd) -> None:  # type: ignore[no-untyped-def]
    order = list(range(len(kjt.keys())))
    rnd.shuffle(order)
    inverse = [order.index(i) for i in range(len(order))]
    assert_same(kjt.permute(order).permute(inverse), kjt)


@PROPS
@given(kjts(), st.data())
def test_permute_matches_per_key_view(kjt: KeyedJaggedTensor, data: st.DataObject) -> None:
    """Any index list (repeats, drops): each output key equals the input's JaggedTensor."""
    indices = data.draw(st.lists(st.integers(0, len(kjt.keys()) - 1), max_size=6))
    out = kjt.permute(indices)
    assert out.keys() == [kjt.keys()[i] for i in indices]
    for j, i in enumerate(indices):
        src, dst = kjt[kjt.keys()[i]], out.split([j, 1, len(indices) - j - 1])[1]
        assert torch.equal(dst.values(), src.values())
        assert torch.equal(dst.lengths(), src.lengths())
        if src.weights_or_none() is not None:
            assert torch.equal(dst.weights(), src.weights())
    out.validate()


@PROPS
@given(kjts(), st.data())
def test_split_then_concat_is_identity(kjt: KeyedJaggedTensor, data: st.DataObject) -> None:
    num_keys = len(kjt.keys())
    cuts = [0, *sorted(data.draw(st.lists(st.integers(0, num_keys), max_size=4))), num_keys]
    # repeated cuts give empty segments
    segments = [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    pieces = kjt.split(segments)
    assert [len(p.keys()) for p in pieces] == segments
    assert_same(KeyedJaggedTensor.concat(pieces), kjt)


@PROPS
@given(kjts())
def test_to_dict_from_jt_dict_round_trip(kjt: KeyedJaggedTensor) -> None:
    assert_same(KeyedJaggedTensor.from_jt_dict(kjt.to_dict()), kjt)


@PROPS
@given(kjts())
def test_lengths_offsets_constructors_agree(kjt: KeyedJaggedTensor) -> None:
    by_offsets = KeyedJaggedTensor.from_offsets_sync(kjt.keys(), kjt.values(), kjt.offsets(), kjt.weights_or_none())
    by_lengths = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), kjt.weights_or_none())
    assert_same(by_offsets, kjt)
    assert_same(by_lengths, kjt)


def test_to_is_asynchronous_only_for_pinned_memory_going_to_cuda():
    from lightning_shardrec.sparse.device_copy import async_copy

    t = torch.ones(2)
    assert async_copy(t, "cuda", None) is False  # pageable host memory: a blocking copy
    assert async_copy(t, "cpu", None) is False
    assert async_copy(t, "cuda", True) is True  # an explicit choice is kept
    if torch.cuda.is_available():
        assert async_copy(t.pin_memory(), "cuda:0", None) is True
