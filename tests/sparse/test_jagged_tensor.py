"""``JaggedTensor``: accessors, dense conversions, movement, validation messages."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shardrec import JaggedTensor

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory/record_stream need CUDA")
PROPS = settings(max_examples=50, deadline=None)


@pytest.fixture
def jt() -> JaggedTensor:
    # bags [[10, 11], [], [12]] with weights
    return JaggedTensor(torch.tensor([10, 11, 12]), torch.tensor([1.0, 0.5, 2.0]), lengths=torch.tensor([2, 0, 1]))


# --- construction and accessors ---------------------------------------------------------
def test_accessors_from_lengths(jt: JaggedTensor) -> None:
    assert jt.values().tolist() == [10, 11, 12]
    assert jt.lengths().tolist() == [2, 0, 1]
    assert jt.offsets().tolist() == [0, 2, 2, 3]
    assert jt.weights().tolist() == [1.0, 0.5, 2.0]
    assert jt.weights_or_none() is jt.weights()


def test_lengths_derived_from_offsets() -> None:
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), offsets=torch.tensor([0, 0, 3]))
    assert jt.lengths().tolist() == [0, 3]
    assert jt.offsets().tolist() == [0, 0, 3]
    assert jt.to_dense()[1].tolist() == [1.0, 2.0, 3.0]


def test_positional_order_is_values_weights_lengths_offsets() -> None:
    # TorchRec: JaggedTensor(values, weights=None, lengths=None, offsets=None)
    values, weights, lengths = (
        torch.tensor([5, 6]),
        torch.tensor([0.25, 0.75]),
        torch.tensor([1, 1]),
    )
    jt = JaggedTensor(values, weights, lengths)
    assert jt.weights() is weights
    assert jt.lengths() is lengths
    jt2 = JaggedTensor(values, None, None, torch.tensor([0, 2]))
    assert jt2.lengths().tolist() == [2]


def test_weights_raises_when_unweighted() -> None:
    jt = JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1]))
    assert jt.weights_or_none() is None
    with pytest.raises(AssertionError, match=re.escape("this JaggedTensor has no weights; use weights_or_none()")):
        jt.weights()


def test_empty() -> None:
    jt = JaggedTensor.empty(is_weighted=True)
    assert jt.values().numel() == 0 and jt.lengths().numel() == 0
    assert jt.weights().numel() == 0
    assert jt.offsets().tolist() == []  # as TorchRec: no bags, no offsets
    assert jt.lengths().dtype == torch.int32 and jt.values().dtype == torch.float32
    assert JaggedTensor.empty().weights_or_none() is None
    assert JaggedTensor.empty().to_dense() == []


# --- dense conversions -------------------------------------------------------------------
def test_to_dense_one_tensor_per_bag(jt: JaggedTensor) -> None:
    assert [b.tolist() for b in jt.to_dense()] == [[10, 11], [], [12]]
    weights = jt.to_dense_weights()
    assert weights is not None
    assert [w.tolist() for w in weights] == [[1.0, 0.5], [], [2.0]]


def test_from_dense_round_trip() -> None:
    bags = [
        torch.tensor([1.0]),
        torch.tensor([]),
        torch.tensor([7.0, 8.0]),
        torch.tensor([10.0, 11.0, 12.0]),
    ]
    weights = [b * 0.5 for b in bags]
    jt = JaggedTensor.from_dense(bags, weights)
    assert jt.lengths().tolist() == [1, 0, 2, 3]
    assert jt.values().tolist() == [1.0, 7.0, 8.0, 10.0, 11.0, 12.0]
    assert jt.weights().tolist() == [0.5, 3.5, 4.0, 5.0, 5.5, 6.0]
    assert [b.tolist() for b in jt.to_dense()] == [b.tolist() for b in bags]


def test_from_dense_rejects_mismatched_weight_bags() -> None:
    with pytest.raises(ValueError, match="from_dense got 2 value bags but 1 weight bags"):
        JaggedTensor.from_dense([torch.tensor([1.0]), torch.tensor([2.0])], [torch.tensor([1.0])])


def test_to_padded_dense_defaults_to_longest_bag(jt: JaggedTensor) -> None:
    assert jt.to_padded_dense().tolist() == [[10, 11], [0, 0], [12, 0]]


def test_to_padded_dense_pads_and_truncates(jt: JaggedTensor) -> None:
    assert jt.to_padded_dense(3, -1).tolist() == [[10, 11, -1], [-1, -1, -1], [12, -1, -1]]
    assert jt.to_padded_dense(1).tolist() == [[10], [0], [12]]
    padded_w = jt.to_padded_dense_weights(2, 9.0)
    assert padded_w is not None
    assert padded_w.tolist() == [[1.0, 0.5], [9.0, 9.0], [2.0, 9.0]]


def test_to_padded_dense_float_values_and_embeddings() -> None:
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([1, 2]))
    assert jt.to_padded_dense(3, 0.5).tolist() == [[1.0, 0.5, 0.5], [2.0, 3.0, 0.5]]
    emb = JaggedTensor(torch.arange(6.0).view(3, 2), lengths=torch.tensor([0, 3]))
    assert emb.to_padded_dense(2).tolist() == [[[0, 0], [0, 0]], [[0, 1], [2, 3]]]


def test_to_padded_dense_of_empty_batch() -> None:
    assert JaggedTensor.empty().to_padded_dense().shape == (0, 0)


@pytest.mark.parametrize("desired_length", [None, 3])
def test_to_padded_dense_exports_with_data_dependent_sizes(desired_length: int | None) -> None:
    # torch.export of a model that pads its bags: the values count (and the longest bag, when no length is
    # given) stay symbolic, so the program serves other lengths (before: GuardOnDataDependentSymNode)
    class Pad(torch.nn.Module):
        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            jt = JaggedTensor(values=values, lengths=lengths, weights=values * 2)
            return jt.to_padded_dense(desired_length) + jt.to_padded_dense_weights(desired_length)

    values = torch.arange(1.0, 7.0)
    program = torch.export.export(Pad(), (values, torch.tensor([2, 1, 0, 3])), strict=False).module()
    for lengths in ([2, 1, 0, 3], [4, 0, 2, 0], [1, 1, 1, 1]):
        torch.testing.assert_close(program(values, torch.tensor(lengths)), Pad()(values, torch.tensor(lengths)))

def test_from_dense_lengths() -> None:
    padded = torch.tensor([[1, 2, 0], [0, 0, 0], [3, 4, 5]])
    weights = padded.float() / 10
    jt = JaggedTensor.from_dense_lengths(padded, torch.tensor([2, 0, 3]), weights)
    assert jt.values().tolist() == [1, 2, 3, 4, 5]
    assert jt.lengths().tolist() == [2, 0, 3]
    torch.testing.assert_close(jt.weights(), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))


@st.composite
def jagged(draw: st.DrawFn) -> tuple[list[int], list[float]]:
    lengths = draw(st.lists(st.integers(0, 5), max_size=8))
    total = sum(lengths)
    values = draw(st.lists(st.floats(-100, 100, width=32), min_size=total, max_size=total))
    return lengths, values


@PROPS
@given(jagged(), st.integers(0, 3))
def test_padded_dense_round_trip(data: tuple[list[int], list[float]], extra: int) -> None:
    lengths, values = data
    jt = JaggedTensor(torch.tensor(values, dtype=torch.float32), lengths=torch.tensor(lengths, dtype=torch.int64))
    padded = jt.to_padded_dense(max(lengths, default=0) + extra, padding_value=-7.0)
    back = JaggedTensor.from_dense_lengths(padded, jt.lengths())
    assert torch.equal(back.values(), jt.values())
    assert torch.equal(back.lengths(), jt.lengths())
    # every padded slot holds the padding value
    mask = torch.arange(padded.shape[1]) >= jt.lengths().unsqueeze(1)
    assert bool((padded[mask] == -7.0).all())


@PROPS
@given(jagged())
def test_from_dense_to_dense_round_trip(data: tuple[list[int], list[float]]) -> None:
    lengths, values = data
    bags = list(torch.split(torch.tensor(values, dtype=torch.float32), lengths))
    jt = JaggedTensor.from_dense(bags)
    assert jt.lengths().tolist() == lengths
    assert [b.tolist() for b in jt.to_dense()] == [b.tolist() for b in bags]


# --- movement ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_to_moves_every_tensor(jt: JaggedTensor, device: str) -> None:
    jt.offsets()  # materialise offsets so they move too
    moved = jt.to(device)
    assert isinstance(moved, JaggedTensor)
    for t in (moved.values(), moved.weights(), moved.lengths(), moved.offsets()):
        assert t.device.type == device
    assert moved.values().shape == jt.values().shape
    assert moved.device().type == device


def test_to_cpu_keeps_data(jt: JaggedTensor) -> None:
    moved = jt.to(torch.device("cpu"), non_blocking=True)
    assert moved.values().tolist() == [10, 11, 12]
    assert moved.lengths().tolist() == [2, 0, 1]


@needs_cuda
def test_pin_memory(jt: JaggedTensor) -> None:
    pinned = jt.pin_memory()
    assert pinned.values().is_pinned() and pinned.weights().is_pinned() and pinned.lengths().is_pinned()
    assert pinned.values().tolist() == jt.values().tolist()


@needs_cuda
def test_record_stream(jt: JaggedTensor) -> None:
    on_gpu = jt.to("cuda")
    on_gpu.record_stream(torch.cuda.current_stream())  # must not raise


def test_pickle_round_trip(jt: JaggedTensor) -> None:
    back = pickle.loads(pickle.dumps(jt))
    assert back.values().tolist() == jt.values().tolist()
    assert back.lengths().tolist() == jt.lengths().tolist()
    assert back.weights().tolist() == jt.weights().tolist()


def test_repr_shows_values_weights_lengths(jt: JaggedTensor) -> None:
    text = repr(jt)
    assert text.startswith("JaggedTensor(")
    assert "values=tensor([10, 11, 12])" in text
    assert "weights=" in text
    assert "lengths=tensor([2, 0, 1])" in text


# --- bad input: construction ------------------------------------------------------------
def test_needs_lengths_or_offsets() -> None:
    with pytest.raises(AssertionError, match=re.escape("JaggedTensor needs lengths or offsets (got neither)")):
        JaggedTensor(torch.tensor([1]))


def test_lengths_sum_more_than_values() -> None:
    with pytest.raises(ValueError, match="JaggedTensor: lengths sum to 4 but there are 3 values"):
        JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 2]))


def test_values_longer_than_the_bags_keep_a_tail_that_is_ignored() -> None:
    """As TorchRec: values past ``sum(lengths)`` belong to no bag."""
    jt = JaggedTensor(torch.tensor([1, 2, 3, 99]), torch.tensor([0.1, 0.2, 0.3, 9.0, 9.0]), torch.tensor([1, 2]))
    assert [b.tolist() for b in jt.to_dense()] == [[1], [2, 3]]
    assert [len(w) for w in jt.to_dense_weights()] == [1, 2]  # type: ignore[union-attr]
    assert jt.to_padded_dense().tolist() == [[1, 0], [2, 3]]
    jt.validate()


def test_offsets_span_disagrees_with_values() -> None:
    with pytest.raises(ValueError, match="JaggedTensor: offsets span 4 values but there are 3"):
        JaggedTensor(torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 1, 4]))


def test_offsets_count_disagrees_with_lengths() -> None:
    msg = re.escape("JaggedTensor: 3 offsets disagree with 3 lengths (offsets need len(lengths) + 1 = 4)")
    with pytest.raises(ValueError, match=msg):
        JaggedTensor(
            torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 1, 1]),
            offsets=torch.tensor([0, 1, 3]),
        )


def test_weights_of_wrong_size() -> None:
    msg = re.escape("JaggedTensor: 2 weights for 3 values (need one per value)")
    with pytest.raises(ValueError, match=msg):
        JaggedTensor(torch.tensor([1, 2, 3]), torch.tensor([1.0, 1.0]), torch.tensor([3]))


def test_lengths_must_be_1d() -> None:
    with pytest.raises(ValueError, match=re.escape("JaggedTensor: lengths must be 1-D, got shape (1, 2)")):
        JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([[1, 1]]))


def test_offsets_must_be_1d_and_non_empty_unless_there_are_no_bags() -> None:
    msg = re.escape("JaggedTensor: offsets must be 1-D with at least one entry, got shape (1, 2)")
    with pytest.raises(ValueError, match=msg):
        JaggedTensor(torch.tensor([1]), offsets=torch.tensor([[0, 1]]))
    msg = re.escape("JaggedTensor: offsets must be 1-D with at least one entry, got shape (0,)")
    with pytest.raises(ValueError, match=msg):
        JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1]), offsets=torch.tensor([], dtype=torch.int64))
    empty = JaggedTensor(torch.tensor([], dtype=torch.int64), offsets=torch.tensor([], dtype=torch.int64))
    assert empty.lengths().numel() == 0 and empty.offsets().numel() == 0


def test_float_lengths_rejected() -> None:
    """A ``ValueError`` that is also the ``AssertionError`` TorchRec raises."""
    msg = "JaggedTensor: lengths must be an integer tensor, got dtype torch.float32"
    with pytest.raises(ValueError, match=msg):
        JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([1.0, 1.0]))
    with pytest.raises(AssertionError, match="offsets must be an integer tensor, got dtype torch.float32"):
        JaggedTensor(torch.tensor([1, 2]), offsets=torch.tensor([0.0, 2.0]))


def test_empty_float_lengths_accepted_as_int32() -> None:
    jt = JaggedTensor(torch.tensor([]), lengths=torch.tensor([]))
    assert jt.lengths().dtype == torch.int32 and jt.to_dense() == []


# --- bad input: validate() ---------------------------------------------------------------
def test_validate_accepts_good_data(jt: JaggedTensor) -> None:
    jt.validate()


def test_negative_length_rejected_at_construction_and_by_validate() -> None:
    # sums to the value count; on CPU the constructor checks the data, validate() re-checks
    # it after in-place edits (and is the only check for device tensors)
    with pytest.raises(ValueError, match=re.escape("JaggedTensor: negative length -1 at bag 1; lengths must be >= 0")):
        JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([3, -1]))
    jt = JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([2, 0]))
    jt.lengths()[:] = torch.tensor([3, -1])
    with pytest.raises(ValueError, match="negative length -1 at bag 1"):
        jt.validate()


def test_offsets_disagree_with_lengths() -> None:
    msg = "offsets disagree with lengths at bag 0: offsets give 2, lengths give 1"
    with pytest.raises(ValueError, match=msg):
        JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3]))
    jt = JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]), offsets=torch.tensor([0, 2, 3]))
    jt.lengths()[:] = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=msg):
        jt.validate()


def test_offsets_must_start_at_zero() -> None:
    with pytest.raises(ValueError, match="offsets must start at 0, got 1"):
        JaggedTensor(torch.tensor([1, 2]), offsets=torch.tensor([1, 2, 3]))
    jt = JaggedTensor(torch.tensor([1, 2]), offsets=torch.tensor([0, 1, 2]))
    jt.offsets()[:] = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="offsets must start at 0, got 1"):
        jt.validate()
