"""What a new user bringing a two-tower model over from plain Lightning tripped on (issue 44, item 7)."""

from __future__ import annotations

import torch
from _models import external_launch
from test_repeated_lookups import ITEMS, PlainTwoTower, loader, trainer

from lightning_shardrec import ParameterConstraints
from lightning_shardrec.testing import run_ranks


class ScoresAllItems(PlainTwoTower):
    """``predict_step`` reads the item table whole: ``.weight`` (refused by name), then the recipe."""

    def predict_step(self, batch, i):
        try:
            self.item.weight  # noqa: B018
            message = "no error"
        except AttributeError as e:
            message = str(e)
        return message, self.item(torch.arange(ITEMS))  # the recipe: one collective lookup of every row


def fit_then_score(rank, world):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(constraints={"item": ParameterConstraints(sharding_types=["row_wise"])}, kernel="torch")
    model = ScoresAllItems()
    t = trainer(strategy=strategy, devices=world, max_steps=2)
    t.fit(model, loader(rank, world))
    ((message, table),) = t.predict(model, torch.utils.data.DataLoader([0], batch_size=None))
    return message, table, strategy.full_state_dict()["item.weight"]


def test_reading_a_sharded_weight_names_its_path_and_the_recipe_that_works():
    for message, table, want in run_ranks(fit_then_score, 2):
        assert message.startswith("Embedding 'item'.weight: the table is sharded"), message
        assert f"self.item(torch.arange({ITEMS})) returns the whole table, exact" in message
        assert "state_dict()['item.weight']" in message and "<path>" not in message
        torch.testing.assert_close(table, want, rtol=0, atol=0)


def fit_accumulating(rank, world):
    import contextlib
    import io
    import logging

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    out, records = io.StringIO(), []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        with contextlib.redirect_stdout(out):
            strategy = ShardRecStrategy(
                kernel="torch", constraints={"item": ParameterConstraints(sharding_types=["row_wise"])}
            )
            trainer(strategy=strategy, devices=world, max_steps=2, accumulate_grad_batches=2).fit(
                PlainTwoTower(), loader(rank, world)
            )
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    return out.getvalue() + "\n".join(records)


def test_the_deferred_updates_line_prints_once():
    (text,) = run_ranks(fit_accumulating, 1)
    assert text.count("table updates are deferred to the optimizer step") == 1, text


def test_the_advice_after_a_rank_failed_on_data_is_to_fix_the_data():
    from lightning_shardrec.lightning.failures.rank_failures import advice

    data = advice("rank 1 failed with IdOutOfRangeError: feature 'big' (table 't_big'): id 7 outside [0, 3)")
    assert data.startswith("This is a data error: fix the ids") and "ckpt_path" not in data
    assert "would replay the same batch" in data
    assert advice("rank 1 is dead (no heartbeat for 60 s)") == (
        "Restart the job and resume with trainer.fit(model, ckpt_path='last')"
    )
    edited = advice("rank 1 failed with PrefetchedBatchEditedError: ShardedEmbeddingBagCollection over features")
    assert edited.startswith("This comes from how the program uses the library") and "ckpt_path" not in edited


def test_where_in_batch_names_the_keys_holding_an_id():
    from lightning_shardrec.lightning.failures.data_errors import where_in_batch
    from lightning_shardrec.sparse import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["u", "i"], values=torch.tensor([1, 9, 2]), lengths=torch.tensor([1, 1, 1, 0]))
    batch = {
        "user_ids": torch.tensor([3, 9]),
        "score": torch.tensor([9.0]),
        "sparse": kjt,
        "rest": (torch.tensor([9]),),
    }
    assert where_in_batch(batch, 9) == ["batch['user_ids']", "batch['sparse']['u']", "batch['rest'][0]"]


def fit_pipelined_collections_and_plain_modules(rank, world):
    import logging

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        row_wise = {t: ParameterConstraints(sharding_types=["row_wise"]) for t in ("user", "item")}
        strategy = ShardRecStrategy(kernel="torch", pipeline=True, constraints=row_wise)
        trainer(strategy=strategy, devices=world, max_steps=2).fit(PlainTwoTower(), loader(rank, world))
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    return [r for r in records if "pipeline=True" in r]


def test_pipeline_on_plain_modules_says_what_it_prefetches():
    from lightning_shardrec.lightning.training.pipeline import prefetch_line

    ((line,),) = run_ranks(fit_pipelined_collections_and_plain_modules, 1)
    assert line == (
        "ShardRecStrategy(pipeline=True): plain modules ['item', 'user'] build their KJT from their call's ids "
        "inside forward, so their input distribution runs in the step as without the pipeline (same results, "
        "no overlap)"
    )

    class Plain:
        spec = None

    assert prefetch_line({"ebc": object(), "item": Plain()}) == (
        "ShardRecStrategy(pipeline=True): the next batch's input distribution is prefetched for ['ebc'] (the KJTs "
        "in the batch); plain modules ['item'] build their KJT from their call's ids inside forward, so their "
        "input distribution runs in the step as without the pipeline (same results, no overlap)"
    )
