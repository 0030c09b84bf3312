"""ShardRecStrategy(pipeline=True) trains exactly as pipeline=False: same weights, bit for bit,
with validation interleaved, a last partial batch, max_steps cutting an epoch, and resume."""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

BATCH = 4  # per rank


def _identity(x):
    return x


def partial_loader(rank, world):
    """Three full batches, then one of half the size (the last partial batch)."""
    from torch.utils.data import DataLoader

    from lightning_shardrec.data.synthetic import SyntheticRecDataset, SyntheticRecGenerator

    dm = data(BATCH, 3)
    gen = SyntheticRecGenerator(dm.spec)
    full = SyntheticRecDataset(dm.spec, batch_size=BATCH, num_batches=3, rank=rank, world_size=world, generator=gen)
    half = SyntheticRecDataset(
        dm.spec, batch_size=BATCH // 2, num_batches=4, rank=rank, world_size=world, generator=gen
    )
    batches = [full.batch(i) for i in range(3)] + [half.batch(3)]
    return DataLoader(batches, batch_size=None, collate_fn=_identity)


class CopyingRec(Rec):
    """Hands the collection a copy of the batch's KJT: the prefetched one is never used."""

    def forward(self, batch):
        from lightning_shardrec import KeyedJaggedTensor

        s = batch.sparse
        copy = KeyedJaggedTensor(s.keys(), s.values().clone(), s.weights_or_none(), s.lengths().clone())
        return self.mlp(torch.cat([batch.dense, self.ebc(copy).values()], 1)).squeeze(1)


def fit(rank, world, pipeline, kind, options, source="datamodule", ckpt_in=None, ckpt_out=None):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[kind]) for f in ("big", "mid", "tiny")}
    strategy = ShardRecStrategy(constraints=constraints, pipeline=pipeline, kernel="torch")  # bitwise: one kernel
    t = trainer(strategy=strategy, devices=world, use_distributed_sampler=False, **options)
    model = Rec("adagrad")
    if source == "partial":
        t.fit(model, train_dataloaders=partial_loader(rank, world), ckpt_path=ckpt_in)
    else:
        t.fit(model, data(BATCH, 5, val_batches=2), ckpt_path=ckpt_in)
    if ckpt_out:
        t.save_checkpoint(ckpt_out)
    stats = strategy.pipeline.stats if strategy.pipeline is not None else None
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return state, stats, t.global_step


CASES = {
    "validation interleaved, 2 epochs": (
        "row_wise",
        {"max_epochs": 2, "val_check_interval": 2, "limit_val_batches": 2},
    ),
    "max_steps mid-epoch": ("table_wise", {"max_steps": 3, "limit_val_batches": 0}),
    "last partial batch, 2 epochs": ("column_wise", {"max_epochs": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_equals_unpipelined(case):
    kind, options = CASES[case]
    source = "partial" if "partial" in case else "datamodule"
    plain = run_ranks(fit, 2, False, kind, options, source)
    piped = run_ranks(fit, 2, True, kind, options, source)
    for rank, ((want, _, steps0), (got, stats, steps1)) in enumerate(zip(plain, piped, strict=True)):
        assert steps0 == steps1
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{case}: rank {rank}: {k} differs"
        # every step but each epoch's first (nothing to look ahead from) and the run's last uses a prefetch
        assert stats.misses == 0 and stats.hits == stats.prefetched > 0, stats
    if case == "max_steps mid-epoch":
        assert piped[0][1].prefetched == 2  # steps 1 and 2 prefetched; step 3 was the last


def test_resume_from_a_pipelined_checkpoint_neither_skips_nor_repeats(tmp_path):
    """3 steps + save + resume to 8 (pipelined) == 8 straight steps (unpipelined), over 2 epochs of 5."""
    kind, options = "row_wise", {"limit_val_batches": 0}
    straight = run_ranks(fit, 2, False, kind, {**options, "max_steps": 8})[0][0]
    half = str(tmp_path / "half.ckpt")
    run_ranks(fit, 2, True, kind, {**options, "max_steps": 3}, "datamodule", None, half)
    resumed, stats, steps = run_ranks(fit, 2, True, kind, {**options, "max_steps": 8}, "datamodule", half)[0]
    assert steps == 8 and stats.prefetched > 0
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), f"resume: {k} differs"


def fit_copying(rank, world):
    import warnings

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(pipeline=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy=strategy, devices=world, max_steps=3).fit(CopyingRec("adagrad"), data(BATCH, 5))
    return strategy.pipeline.stats, [str(w.message) for w in caught]


def test_a_copied_kjt_misses_the_prefetch_and_warns():
    (stats, caught), _ = run_ranks(fit_copying, 2)
    assert stats.hits == 0 and stats.misses == 2 and stats.prefetched == 2, stats
    assert any(
        "ShardedEmbeddingBagCollection was not called with the prefetched KeyedJaggedTensor" in m for m in caught
    )


class EditingRec(Rec):
    """Edits the batch's KJT in place before the lookup (ids folded into the smallest table's rows)."""

    def forward(self, batch):
        batch.sparse.values().remainder_(2)
        return super().forward(batch)


def fit_editing(rank, world):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.errors import PrefetchedBatchEditedError

    external_launch(rank, world)
    strategy = ShardRecStrategy(pipeline=True, heartbeat_timeout=None)
    try:
        trainer(strategy=strategy, devices=world, max_steps=3).fit(EditingRec("adagrad"), data(BATCH, 5))
    except PrefetchedBatchEditedError as err:
        return str(err)
    return None


def test_a_kjt_edited_in_place_after_its_prefetch_is_refused():
    """Ids sent one step early then edited in place would train on the stale ids: every rank stops at the
    first pipelined step, naming the collection and the way out (not a silent divergence)."""
    for message in run_ranks(fit_editing, 2):
        assert message is not None and "was changed in place" in message
        assert "ShardedEmbeddingBagCollection over features" in message and "pipeline=False" in message


def fit_copying_by_default(rank, world):
    import warnings

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(kernel="torch")  # the pipeline at its default: on, on 2 ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy=strategy, devices=world, max_steps=4).fit(CopyingRec("adagrad"), data(BATCH, 5))
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return strategy.pipeline.stats, [str(w.message) for w in caught], state


def fit_copying_unpipelined(rank, world):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(kernel="torch", pipeline=False)
    trainer(strategy=strategy, devices=world, max_steps=4).fit(CopyingRec("adagrad"), data(BATCH, 5))
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


def test_by_default_a_collection_fed_a_copy_stops_being_prefetched():
    """The default pipeline prefetches steps 1 and 2's batches (step 2's before step 1's forward missed), the
    forwards miss them (copies), and the collection is not prefetched again (asked for, steps 1-3 would be):
    two wasted exchanges in 4 steps, no warning, the same weights as pipeline=False."""
    (stats, caught, state), _ = run_ranks(fit_copying_by_default, 2)
    assert stats.prefetched == 2 and stats.misses == 2 and stats.hits == 0, stats
    assert not any("was not called with the prefetched" in m for m in caught)
    plain = run_ranks(fit_copying_unpipelined, 2)[0]
    for k in plain:
        assert torch.equal(state[k], plain[k]), k


class OffsetsRec(Rec):
    """Reads the batch KJT's offsets before the lookup: the KJT derives them then (a cache, not an edit)."""

    def forward(self, batch):
        assert batch.sparse.offsets()[-1] == batch.sparse.values().numel()
        return super().forward(batch)


def fit_offsets(rank, world, pipeline):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(kernel="torch", pipeline=pipeline)
    trainer(strategy=strategy, devices=world, max_steps=4).fit(OffsetsRec("adagrad"), data(BATCH, 5))
    stats = strategy.pipeline.stats if strategy.pipeline is not None else None
    return stats, {k: v.clone() for k, v in strategy.full_state_dict().items()}


def test_a_kjt_deriving_its_offsets_after_the_prefetch_is_not_an_edit():
    (stats, piped), _ = run_ranks(fit_offsets, 2, None)
    assert stats.hits == 3 and stats.misses == 0, stats
    (_, plain), _ = run_ranks(fit_offsets, 2, False)
    for k in plain:
        assert torch.equal(piped[k], plain[k]), k
