"""After fit, ``torch.save(model.state_dict())`` on rank 0 alone (what DDP users do) works when the tables fit.

At the end of fit every rank gathers the full tables to rank 0 (lightning/checkpoints/after_fit.py: by default
when they take at most 64 MiB, with ``full_tables_after_fit=True`` whenever they fit); rank 0's
``model.state_dict()`` then equals the collective ``trainer.strategy.full_state_dict()`` and loads
into the plain model. Elsewhere, or where the tables do not fit, ``ShardedStateError`` says why.
"""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.lightning.checkpoints import after_fit
from lightning_shardrec.testing import run_ranks


def fit_then_rank_zero_state(rank, world, share):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.errors import ShardedStateError

    external_launch(rank, world)
    before, after_fit.SHARE = after_fit.SHARE, share  # restored: the rank processes run later tests too
    try:
        model = Rec()
        t = trainer(strategy=ShardRecStrategy(full_tables_after_fit=True), devices=world, max_steps=2)
        t.fit(model, data(4, 2))
        full = {k: v.clone() for k, v in t.strategy.full_state_dict().items()}  # collective: every rank
        try:
            mine = {k: v.clone() for k, v in model.state_dict().items()}  # this rank alone
        except ShardedStateError as e:
            mine = str(e)
    finally:
        after_fit.SHARE = before
    return full, mine


def test_rank_zero_state_dict_after_fit_holds_the_full_tables():
    (full, mine), (_, other) = run_ranks(fit_then_rank_zero_state, 2, after_fit.SHARE)
    assert set(mine) == set(full)
    for k in full:
        torch.testing.assert_close(mine[k], full[k], rtol=0, atol=0, msg=k)
    Rec().load_state_dict(mine)  # the plain model's keys
    assert "(the full tables are held only on rank 0 after a fit)" in other
    assert other.startswith("ShardedEmbeddingBagCollection 'ebc'.state_dict(): the module is sharded")


def test_tables_that_do_not_fit_are_not_gathered_and_the_error_shows_the_arithmetic():
    (_, mine), _ = run_ranks(fit_then_rank_zero_state, 2, 1e-12)
    assert "trainer.strategy.full_state_dict() on every rank" in mine
    assert "(the full tables need 0.00 GiB and do not fit in 0% of rank 0's " in mine
    assert mine.endswith(" GiB available host memory)")


def test_fits_states_the_arithmetic():
    assert after_fit.fits(2 * 1024**3, 4 * 1024**3) == (
        False,
        "the full tables need 2.00 GiB and do not fit in 25% of rank 0's 4.0 GiB available host memory",
    )
    assert after_fit.fits(1024**3, 4 * 1024**3)[0]
    assert not after_fit.fits(1, None)[0]


def test_by_default_only_small_tables_are_gathered_and_the_reason_names_the_option():
    assert after_fit.over_default(after_fit.AUTO_BYTES) == ""
    assert after_fit.over_default(256 * 1024**2) == (
        "the full tables need 256.0 MiB, over the 64 MiB gathered to rank 0 by default, so each rank kept only its "
        "share; ShardRecStrategy(full_tables_after_fit=True) gathers them at the end of fit when they fit in 25% of "
        "rank 0's available host memory"
    )


def test_full_tables_after_fit_takes_none_true_or_false():
    from lightning_shardrec import ShardRecStrategy

    for value in (None, True, False):
        assert ShardRecStrategy(full_tables_after_fit=value).options.full_tables_after_fit is value
    with pytest.raises(
        ValueError,
        match=r"full_tables_after_fit must be None \(default: tables of at most 64 MiB\), "
        r"True or False, got 'auto'",
    ):
        ShardRecStrategy(full_tables_after_fit="auto")


def fit_twice_then_alone(rank, world):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.errors import CollectiveCallError

    external_launch(rank, world)
    model = Rec()
    first = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2)
    first.fit(model, data(4, 2))  # gathered to rank 0 (default: small tables)
    held = len(first.strategy.guard.full)
    later = trainer(strategy=ShardRecStrategy(full_tables_after_fit=False), devices=world, max_steps=2)
    dm = data(4, 2, seed=5)
    later.fit(model, dm)  # a second Trainer adopts the model: the tables change, nothing gathered
    out = {"held": held, "still": len(first.strategy.guard.full)}  # the first Trainer still exists
    try:
        with torch.no_grad():
            model(next(iter(dm.train_dataloader())))  # this rank alone
    except CollectiveCallError as e:
        out["forward"] = str(e)
    return out


def test_a_later_trainer_releases_the_copy_gathered_after_an_earlier_fit():
    first, other = run_ranks(fit_twice_then_alone, 2)
    assert (first["held"], first["still"], other["held"]) == (1, 0, 0)  # rank 0's copy freed, not kept stale
    assert first["forward"].startswith("ShardedEmbeddingBagCollection 'ebc' was called outside trainer.fit")
