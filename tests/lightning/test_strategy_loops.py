"""validate / test / predict on the sharded model, and a bad id that must stop every rank."""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks


def eval_sharded(rank, world):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    model = Rec()
    t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2, limit_val_batches=2)
    dm = data(4, 2, val_batches=2)
    t.fit(model, dm)
    metrics = t.validate(model, dm, verbose=False)
    preds = t.predict(model, dm.val_dataloader())
    state = t.strategy.full_state_dict()
    return metrics, [p.clone() for p in preds], {k: v.clone() for k, v in state.items()}


def test_validate_and_predict_match_the_plain_model():
    results = run_ranks(eval_sharded, 2)
    state = results[0][2]
    plain = Rec()
    plain.load_state_dict(state)
    plain.eval()
    dm = data(8, 2, val_batches=2)
    dm.setup("predict")
    with torch.no_grad():
        want = [plain(b) for b in dm.val_dataloader()]
    for rank, (metrics, preds, _) in enumerate(results):
        assert "val_loss" in metrics[0]
        for got, full in zip(preds, want, strict=False):
            torch.testing.assert_close(got, full[rank * 4 : (rank + 1) * 4], rtol=1e-5, atol=1e-6)
    assert results[0][0] == results[1][0]  # sync_dist: the same validation loss everywhere


class LoaderBadIdRec(Rec):
    """Rank 1's second training batch holds an out-of-range id from the data (set as it reaches the device,
    before the pipeline sends its ids)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.moved = getattr(self, "moved", -1) + 1
        if self.moved == 1 and self.global_rank == 1:
            batch.sparse.values()[0] = 10**6
        return batch


def bad_id_run(rank, world, pipeline):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    t = trainer(strategy=ShardRecStrategy(pipeline=pipeline), devices=world, max_steps=4, limit_val_batches=0)
    # without the pipeline the id is edited into the batch in training_step; with it (the default on 2 ranks,
    # which refuses a batch edited in place after its prefetch) it comes with the data
    model = Rec(bad_id_at=1) if pipeline is False else LoaderBadIdRec()
    try:
        t.fit(model, data(4, 4))
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank saw
        return f"{type(e).__name__}: {e}"
    return "finished"


@pytest.mark.parametrize("pipeline", [False, None])
def test_bad_id_on_one_rank_stops_the_run(pipeline):
    r0, r1 = run_ranks(bad_id_run, 2, pipeline, timeout=90)
    assert r1.startswith("IdOutOfRangeError: feature 'big' (table 't_big'): id 1000000 outside [0, 120)")
    # the step and the batch key, and how to get past a data error (not a resume, which replays the batch)
    assert ", at training step 1 (batch_idx 1); the id is in batch.sparse['big']. This is a data error" in r1
    assert "ckpt_path='last'" not in r1
    assert r0.startswith("ShardingError: rank 0: ranks [1] rejected their batch")


def fit_with_trainer_options(rank, world, options):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=3, **options)
    model = Rec()
    t.fit(model, data(4, 3))
    return float(t.callback_metrics["loss"])


def test_mixed_precision_and_gradient_clipping_run():
    """bf16 autocast reaches the dense layers; value clipping runs (its exactness: test_strategy_habits)."""
    for options in ({"precision": "bf16-mixed"}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}):
        losses = run_ranks(fit_with_trainer_options, 2, options)
        assert all(0 < x < 10 for x in losses), (options, losses)
