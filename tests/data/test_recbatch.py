"""RecBatch: shape checks, movement, pickling, and what Lightning's helpers make of it."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision
from lightning.pytorch.utilities.data import extract_batch_size
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_shardrec.data import RecBatch
from lightning_shardrec.sparse import KeyedJaggedTensor


def _batch(b: int = 3, weighted: bool = False) -> RecBatch:
    lengths = torch.tensor([2, 0, 1] * (b // 3) + [1, 1, 1] * (b // 3))
    values = torch.arange(int(lengths.sum()))
    weights = torch.rand(values.numel()) if weighted else None
    kjt = KeyedJaggedTensor(["a", "b"], values, weights, lengths=lengths)
    return RecBatch(torch.randn(b, 4), kjt, torch.tensor([0.0, 1.0, 1.0] * (b // 3)))


def test_fields_and_batch_size() -> None:
    batch = _batch(6)
    assert batch.batch_size == 6
    assert batch.sparse.stride() == 6


@pytest.mark.parametrize(
    ("dense", "labels", "stride", "match"),
    [
        (torch.zeros(3), torch.zeros(3), 3, r"RecBatch.dense must be \[B, D\], got shape \(3,\)"),
        (
            torch.zeros(3, 2),
            torch.zeros(3, 1),
            3,
            r"RecBatch.labels must be \[B\], got shape \(3, 1\)",
        ),
        (torch.zeros(3, 2), torch.zeros(4), 3, "dense has 3 rows but labels has 4"),
        (
            torch.zeros(2, 2),
            torch.zeros(2),
            3,
            r"dense has 2 rows but sparse \(keys \['a'\]\) has stride 3",
        ),
    ],
)
def test_shape_errors(dense: torch.Tensor, labels: torch.Tensor, stride: int, match: str) -> None:
    kjt = KeyedJaggedTensor(
        ["a"], torch.arange(stride), lengths=torch.ones(stride, dtype=torch.long)
    )
    with pytest.raises(ValueError, match=match):
        RecBatch(dense, kjt, labels)


def _assert_equal(a: RecBatch, b: RecBatch) -> None:
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
    if a.sparse.weights_or_none() is not None:
        assert torch.equal(a.sparse.weights(), b.sparse.weights())


def test_pickle_round_trip() -> None:
    batch = _batch(6, weighted=True)
    _assert_equal(pickle.loads(pickle.dumps(batch)), batch)


def test_to_and_lightning_move_data_to_device() -> None:
    batch = _batch(3)
    moved = batch.to("meta")
    assert (
        moved.dense.device.type
        == moved.labels.device.type
        == moved.sparse.values().device.type
        == "meta"
    )
    # Lightning's transfer helper calls RecBatch.to, also inside containers
    out = move_data_to_device({"batch": batch}, torch.device("meta"))
    assert isinstance(out["batch"], RecBatch)
    assert out["batch"].sparse.lengths().device.type == "meta"
    assert batch.dense.device.type == "cpu"  # the original is untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory/record_stream need CUDA")
def test_pin_memory_and_record_stream_cuda() -> None:
    pinned = _batch(3, weighted=True).pin_memory()
    assert pinned.dense.is_pinned() and pinned.sparse.values().is_pinned()
    stream = torch.cuda.Stream()
    on_gpu = pinned.to("cuda", non_blocking=True)
    on_gpu.record_stream(stream)
    torch.cuda.synchronize()
    assert on_gpu.sparse.values().is_cuda


def test_extract_batch_size_finds_b_without_warning() -> None:
    batch = _batch(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert extract_batch_size(batch) == 6
        assert extract_batch_size({"x": batch}) == 6


def test_iter_yields_batch_major_tensors() -> None:
    batch = _batch(3)
    dense, labels = batch
    assert dense is batch.dense and labels is batch.labels


@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [(DoublePrecision(), torch.float64), (HalfPrecision("bf16-true"), torch.bfloat16)],
)
def test_true_precision_plugins_cast_dense(plugin: object, dtype: torch.dtype) -> None:
    batch = _batch(3)
    out = plugin.convert_input(batch)  # type: ignore[attr-defined]
    assert isinstance(out, RecBatch) and out.dense.dtype == dtype
    assert out.sparse.values().dtype == torch.int64  # ids untouched
    assert apply_to_collection(batch, torch.Tensor, lambda t: t) is not None
