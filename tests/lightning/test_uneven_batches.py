"""Uneven training data across ranks trains to the end (``uneven_batches="pad"``, the default).

Each rank reads its own ``IterableDataset`` of a different length; a rank whose data ends
trains on with empty batches until every rank's has ended. The result equals one process
(no strategy) over the same per-step global batches: step ``k`` is the rows of every rank
that still had a batch ``k``. The loss sums over rows and divides by a constant, so DDP's
average over ranks (``1/W Σ_r``) is the one process's ``sum / (W * B)`` (lightning/training/uneven.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import Rec, data, external_launch, trainer

from lightning_shardrec import KeyedJaggedTensor
from lightning_shardrec.data import RecBatch
from lightning_shardrec.lightning.training.uneven import empty_like, is_empty, zero_loss
from lightning_shardrec.testing import run_ranks

BATCH = 4  # rows per rank and step
TOL = {"rtol": 1e-5, "atol": 1e-6}
KINDS = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "data_parallel"}


class SumRec(Rec):
    """``Rec`` with ``loss = BCE summed over rows / scale``: a step's rows weigh the same wherever they are."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def training_step(self, batch, i):
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels, reduction="sum") / self.scale


class Batches(torch.utils.data.IterableDataset):
    """A per-rank stream of batches (no length), as a sharded-file reader deals them."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def rank_batches(counts: list[int]) -> list[list[RecBatch]]:
    """Rank ``r``'s batches: ``counts[r]`` distinct batches of ``BATCH`` rows."""
    dm = data(BATCH, sum(counts))
    dm.setup("fit")
    made = iter(range(sum(counts)))
    return [[dm.datasets["train"].batch(next(made)) for _ in range(n)] for n in counts]


def cat(batches: list[RecBatch]) -> RecBatch:
    """One batch of the rows of ``batches`` in order (the KJT's ids per key, batch after batch)."""
    keys = batches[0].sparse.keys()
    parts = [b.sparse.to_dict() for b in batches]
    values = torch.cat([p[k].values() for k in keys for p in parts])
    lengths = torch.cat([p[k].lengths() for k in keys for p in parts])
    sparse = KeyedJaggedTensor(keys, values, lengths=lengths)
    return RecBatch(torch.cat([b.dense for b in batches]), sparse, torch.cat([b.labels for b in batches]))


def strategy(**kwargs):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in KINDS.items()}
    return ShardRecStrategy(constraints=constraints, **kwargs)


def fit_uneven(rank, world, batches, epochs, options):
    external_launch(rank, world)
    loader = torch.utils.data.DataLoader(Batches(batches[rank]), batch_size=None)
    t = trainer(strategy=strategy(**options), devices=world, max_epochs=epochs)
    model = SumRec(BATCH)
    t.fit(model, loader)
    state = {k: v.clone() for k, v in t.strategy.full_state_dict().items()}
    return state, t.global_step, t.strategy.padding.padded_steps


def one_process(batches: list[list[RecBatch]], epochs: int) -> dict[str, torch.Tensor]:
    steps = max(map(len, batches))
    world = len(batches)
    global_batches = [cat([b[k] for b in batches if k < len(b)]) for k in range(steps)]
    model = SumRec(world * BATCH)
    loader = torch.utils.data.DataLoader(Batches(global_batches), batch_size=None)
    trainer(devices=1, max_epochs=epochs).fit(model, loader)
    return model.state_dict()


@pytest.mark.parametrize(
    ("counts", "epochs", "options"),
    [
        ([3, 1], 1, {}),
        ([1, 3], 2, {"pipeline": True}),
        ([3, 1, 2], 1, {}),
    ],
)
def test_uneven_per_rank_data_trains_every_batch_equal_to_one_process(counts, epochs, options):
    batches = rank_batches(counts)
    want = one_process(batches, epochs)
    steps = max(counts)
    for rank, (got, step, padded) in enumerate(run_ranks(fit_uneven, len(counts), batches, epochs, options)):
        assert step == steps * epochs, f"rank {rank}"
        assert padded == (steps - counts[rank]) * epochs, f"rank {rank}"
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"rank {rank} {counts} {options}: {k}")


def test_strict_mode_still_stops_every_rank_by_name():
    batches = rank_batches([3, 2])
    from lightning_shardrec.errors import UnevenBatchesError

    with pytest.raises(RuntimeError, match="UnevenBatchesError") as info:
        run_ranks(fit_uneven, 2, batches, 1, {"uneven_batches": "error"})
    assert "uneven batch counts: the training data of ranks [1] ends after 2 batches in epoch 0" in str(info.value)
    assert UnevenBatchesError.__name__ in str(info.value)


def test_uneven_batches_option_is_checked():
    from lightning_shardrec import ShardRecStrategy

    with pytest.raises(ValueError, match=r"uneven_batches must be one of \['pad', 'error'\], got 'drop'"):
        ShardRecStrategy(uneven_batches="drop")


def test_empty_like_keeps_the_structure_with_zero_rows():
    batch = rank_batches([1])[0][0]
    empty = empty_like({"rec": batch, "ids": [torch.ones(3, 2)], "name": "x", "n": 5})
    rec = empty["rec"]
    assert isinstance(rec, RecBatch) and rec.dense.shape == (0, 3) and rec.labels.shape == (0,)
    assert rec.sparse.keys() == batch.sparse.keys() and rec.sparse.stride() == 0 and rec.sparse.values().numel() == 0
    assert empty["ids"][0].shape == (0, 2) and (empty["name"], empty["n"]) == ("x", 5)
    assert is_empty(empty) and not is_empty(batch) and not is_empty({"n": 5})
    nan = torch.tensor(float("nan"), requires_grad=True)
    assert zero_loss({"loss": nan})["loss"].item() == 0.0
