"""RecBatchLoader: order with workers, state_dict / load_state_dict, errors."""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.data import FeatureSpec, RecBatchLoader, SyntheticRecDataset, SyntheticSpec

SPEC = SyntheticSpec(features=(FeatureSpec(name="a", num_embeddings=100),), num_dense=2)


def _ds(n: int = 6) -> SyntheticRecDataset:
    return SyntheticRecDataset(SPEC, batch_size=4, num_batches=n)


def _keys(batches: list) -> list[float]:
    return [round(float(b.dense.sum()), 5) for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_exactly(num_workers: int) -> None:
    full = _keys(list(RecBatchLoader(_ds(), num_workers=num_workers)))
    loader = RecBatchLoader(_ds(), num_workers=num_workers)
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    state = loader.state_dict()
    assert state == {"next_batch": 2}
    del it
    resumed = RecBatchLoader(_ds(), num_workers=num_workers)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert _keys(first) + _keys(rest) == full
    assert resumed.state_dict() == {"next_batch": 0}  # epoch consumed: the next one starts at 0
    assert _keys(list(resumed)) == full  # and the resume offset applied to one iteration only


def test_len_and_fresh_state() -> None:
    loader = RecBatchLoader(_ds(5))
    assert len(loader) == 5 and loader.state_dict() == {"next_batch": 0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 8}, "set batch_size on the dataset / DataModule, not on the loader"),
        (
            {"persistent_workers": True, "num_workers": 1},
            "does not support persistent_workers=True",
        ),
    ],
)
def test_loader_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RecBatchLoader(_ds(), **kwargs)


def test_loader_needs_indexed_dataset() -> None:
    with pytest.raises(
        ValueError, match="RecBatchLoader needs an IndexedBatchDataset, got TensorDataset"
    ):
        RecBatchLoader(torch.utils.data.TensorDataset(torch.zeros(2)))  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [{"next_batch": 7}, {"next_batch": -1}, {}, {"next_batch": "2"}])
def test_load_state_dict_errors(state: dict) -> None:
    with pytest.raises(
        ValueError, match=r"next_batch must be an int in \[0, 6\] \(this loader has 6 batches\)"
    ):
        RecBatchLoader(_ds()).load_state_dict(state)


def test_a_dataset_must_define_batch() -> None:
    from lightning_shardrec.data import IndexedBatchDataset

    class NoBatch(IndexedBatchDataset):
        pass

    with pytest.raises(TypeError, match="abstract method '?batch"):
        NoBatch(batch_size=4, num_batches=2)
