"""Ordinary Lightning habits under strategy="shardrec": each gives the devices=1 result or stops by name.

validate before fit, fit twice, the fused rule each table gets (and strict_optimizer), gradient
clipping, the model used after fit, uneven batch counts across ranks, and shardrec checkpoints
read without the strategy.
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import Rec, data, external_launch, trainer

from lightning_shardrec import FusedOptimConfig
from lightning_shardrec.lightning.parameters.optimizers import derive_fused_config, rule_report
from lightning_shardrec.testing import run_ranks

BATCH = 6  # per rank
STEPS = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}
KINDS = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "data_parallel"}


def strategy(**kwargs):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in KINDS.items()}
    return ShardRecStrategy(constraints=constraints, **kwargs)


def full_state(t):
    return {k: v.clone() for k, v in t.strategy.full_state_dict().items()}


def assert_same(got, want, what):
    assert set(got) == set(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=f"{what}: {k}")


# --- 1 and 2: the fused optimizer follows the configure_optimizers of the fit that trains -------------
def sharded_habit(rank, world, habit, options):
    external_launch(rank, world)
    model = Rec(**options)
    if habit == "validate_then_fit":
        t = trainer(strategy=strategy(), devices=world, max_steps=STEPS, limit_val_batches=2)
        t.validate(model, data(BATCH, STEPS, val_batches=2), verbose=False)
        t.fit(model, data(BATCH, STEPS))
        return full_state(t)
    if habit == "fit_twice":  # a second Trainer: Lightning builds a fresh dense optimizer (and scheduler)
        trainer(strategy=strategy(), devices=world, max_steps=STEPS // 2).fit(model, data(BATCH, STEPS))
        t = trainer(strategy=strategy(), devices=world, max_steps=STEPS // 2)
        t.fit(model, data(BATCH, STEPS, seed=2))
        return full_state(t)
    if habit == "fit_twice_same_trainer":
        t = trainer(strategy=strategy(), devices=world, max_steps=STEPS // 2)
        t.fit(model, data(BATCH, STEPS))
        t.fit_loop.epoch_loop.max_steps = STEPS
        t.fit(model, data(BATCH, STEPS, seed=2))
        return full_state(t)
    raise AssertionError(habit)


def reference_habit(world, habit, options):
    model = Rec(**options)
    if habit == "validate_then_fit":
        trainer(devices=1, max_steps=STEPS).fit(model, data(BATCH * world, STEPS))
    elif habit == "fit_twice":
        trainer(devices=1, max_steps=STEPS // 2).fit(model, data(BATCH * world, STEPS))
        trainer(devices=1, max_steps=STEPS // 2).fit(model, data(BATCH * world, STEPS, seed=2))
    else:
        t = trainer(devices=1, max_steps=STEPS // 2)
        t.fit(model, data(BATCH * world, STEPS))
        t.fit_loop.epoch_loop.max_steps = STEPS
        t.fit(model, data(BATCH * world, STEPS, seed=2))
    return model.state_dict()


@pytest.mark.parametrize(
    ("world", "habit", "options"),
    [
        (2, "validate_then_fit", {"optimizer": "sgd", "lr": 0.3}),
        (3, "validate_then_fit", {"optimizer": "adagrad", "lr": 0.05}),
        (2, "fit_twice", {"optimizer": "adagrad", "lr": 0.05, "scheduler": True}),
        (3, "fit_twice", {"optimizer": "adagrad", "lr": 0.05}),
        (2, "fit_twice_same_trainer", {"optimizer": "adagrad", "lr": 0.05}),
    ],
)
def test_fused_optimizer_follows_each_fit(world, habit, options):
    want = reference_habit(world, habit, options)
    for rank, got in enumerate(run_ranks(sharded_habit, world, habit, options)):
        assert_same(got, want, f"{habit} W={world} rank {rank}")


# --- 3: the rule each table gets, said at fit start; strict_optimizer refuses the inexact ones ---------
def _holder(opt_cls, **hparams):
    opt = opt_cls([torch.nn.Parameter(torch.zeros(2))], **hparams)
    return opt, opt.param_groups[0]


def test_fit_start_report_names_each_tables_rule():
    exact = _holder(torch.optim.Adagrad, lr=0.05)
    line = rule_report(exact, derive_fused_config(*exact), False, ["t_big"], ["t_tiny"], strict=True)
    assert "fused tables ['t_big'] train with 'adagrad' (lr=0.05, eps=1e-10, weight_decay=0) derived from" in line
    assert "exact: each row moves as in one process" in line
    assert "data-parallel tables ['t_tiny'] train in Adagrad itself (exact)" in line
    adam = _holder(torch.optim.Adam, lr=0.01)
    line = rule_report(adam, derive_fused_config(*adam), False, ["t_big"], [], strict=False)
    assert "'adam' (lr=0.01, eps=1e-08, betas=(0.9, 0.999), weight_decay=0) derived from Adam" in line
    assert "row-sparse ('lazy') Adam: a row a batch does not touch keeps its weight and moments" in line
    assert "torch.optim.SparseAdam's rule and TorchRec's fused Adam" in line
    sgd = _holder(torch.optim.SGD, lr=0.1, weight_decay=0.01)
    line = rule_report(sgd, derive_fused_config(*sgd), False, ["t_big"], [], strict=False)
    assert "weight_decay=0.01 decays only the rows a batch touches; torch.optim.SGD decays every row" in line
    given = FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.05)
    line = rule_report(exact, given, True, ["t_big"], [], strict=False)
    assert "embedding_optimizer/embedding_lr set the tables' rule to 'rowwise_adagrad'" in line
    line = rule_report(None, FusedOptimConfig(), False, ["t_big"], [], strict=False)
    assert "no optimizer of configure_optimizers holds the tables' parameters" in line


@pytest.mark.parametrize(
    "opt",
    [
        _holder(torch.optim.Adam, lr=0.01),
        _holder(torch.optim.AdamW, lr=0.01),
        _holder(torch.optim.SGD, lr=0.1, weight_decay=0.1),
    ],
)
def test_strict_optimizer_refuses_inexact_rules(opt):
    strict = r"ShardRecStrategy\(strict_optimizer=True\): fused tables \['t_big'\] would train"
    with pytest.raises(ValueError, match=strict):
        rule_report(opt, derive_fused_config(*opt), False, ["t_big"], [], strict=True)


def test_maximize_is_refused():
    opt = _holder(torch.optim.Adagrad, lr=0.1, maximize=True)
    with pytest.raises(ValueError, match=r"Adagrad\(maximize=True\) has no fused form"):
        derive_fused_config(*opt)


class AdamRec(Rec):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit_strict(rank, world):
    external_launch(rank, world)
    t = trainer(strategy=strategy(strict_optimizer=True), devices=world, max_steps=2)
    try:
        t.fit(AdamRec(), data(4, 2))
    except ValueError as e:
        return str(e)
    return "trained"


def test_strict_optimizer_stops_an_adam_fit_on_every_rank():
    for msg in run_ranks(fit_strict, 2):
        assert msg.startswith("ShardRecStrategy(strict_optimizer=True): fused tables ['t_big', 't_mid'] would train")
        assert "row-sparse ('lazy') Adam" in msg


# --- 4: gradient clipping ---------------------------------------------------------------------------
def fit_clipped(rank, world, options):
    external_launch(rank, world)
    t = trainer(strategy=strategy(), devices=world, max_steps=STEPS, **options)
    try:
        t.fit(Rec("sgd", lr=0.5), data(BATCH, STEPS))
    except ValueError as e:
        return str(e)
    clips = {k.grad_clip_value for s in t.strategy.sharded.values() for k in s.kernels()}
    assert clips <= {options.get("gradient_clip_val")}  # a rank may hold no fused shard
    return full_state(t)


@pytest.mark.parametrize("world", [2, 3])
def test_value_clipping_is_exact(world):
    clip = {"gradient_clip_val": 0.004, "gradient_clip_algorithm": "value"}
    model = Rec("sgd", lr=0.5)
    trainer(devices=1, max_steps=STEPS, **clip).fit(model, data(BATCH * world, STEPS))
    want = model.state_dict()
    unclipped = Rec("sgd", lr=0.5)
    trainer(devices=1, max_steps=STEPS).fit(unclipped, data(BATCH * world, STEPS))
    key = "ebc.embedding_bags.t_big.weight"
    assert (unclipped.state_dict()[key] - want[key]).abs().max() > 1e-3  # the clipping engages
    for rank, got in enumerate(run_ranks(fit_clipped, world, clip)):
        assert_same(got, want, f"value clipping W={world} rank {rank}")


class LateNormClip(Rec):
    """Clips by norm in ``on_before_optimizer_step``: after the tables were updated in backward."""

    def __init__(self):
        super().__init__("sgd", lr=0.5)

    def on_before_optimizer_step(self, optimizer):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class ManualClip(Rec):
    def __init__(self):
        super().__init__("sgd", lr=0.5, manual=True)

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.binary_cross_entropy_with_logits(self(batch), batch.labels))
        self.clip_gradients(opt, gradient_clip_val=0.004, gradient_clip_algorithm="value")
        opt.step()


def fit_late_clip(rank, world, cls):
    external_launch(rank, world)
    t = trainer(strategy=strategy(), devices=world, max_steps=STEPS)
    try:
        t.fit(cls(), data(BATCH, STEPS))
    except ValueError as e:
        return str(e)
    return full_state(t)


def test_a_norm_clip_the_strategy_was_not_told_of_is_refused_by_name():
    for msg in run_ranks(fit_late_clip, 2, LateNormClip):
        assert msg.startswith("ShardRecStrategy: clip_gradients(gradient_clip_algorithm='norm') was called in a fit")
        assert "the strategy then defers the table updates to the optimizer step (exact)" in msg


def test_clipping_after_a_manual_backward_is_exact():
    """Manual optimization defers the table updates to ``opt.step()``: ``clip_gradients`` reaches them."""
    model = ManualClip()
    trainer(devices=1, max_steps=STEPS).fit(model, data(BATCH * 2, STEPS))
    for rank, got in enumerate(run_ranks(fit_late_clip, 2, ManualClip)):
        assert_same(got, model.state_dict(), f"manual value clipping rank {rank}")


# --- 5: the model after fit ---------------------------------------------------------------------------
def use_after_fit(rank, world):
    from lightning_shardrec.errors import CollectiveCallError, ShardedStateError

    external_launch(rank, world)
    model = Rec()
    t = trainer(strategy=strategy(full_tables_after_fit=True), devices=world, max_steps=2)
    dm = data(4, 2)
    t.fit(model, dm)
    out = {}
    try:
        model.state_dict()
    except ShardedStateError as e:
        out["state_dict"] = str(e)
    batch = next(iter(dm.train_dataloader()))
    # `if trainer.is_global_zero: model(batch)`: rank 0 runs it on the full tables it holds after fit
    # (test_after_fit.py); on any other rank a lone call stops at once by name
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out["alone"] = model(batch).clone()
    except CollectiveCallError as e:
        out["forward"] = str(e)
    out["seconds"] = time.perf_counter() - start
    with t.strategy.collective(), torch.no_grad():  # every rank: allowed
        out["pred"] = model(batch).clone()
    out["full"] = full_state(t)
    out["batch"] = batch
    return out


def test_after_fit_rank_zero_state_dict_and_forward_work_other_ranks_stop_by_name():
    results = run_ranks(use_after_fit, 2)
    for r in results[1:]:  # rank 0 holds the full tables after fit (test_after_fit.py)
        assert r["state_dict"].startswith(
            "ShardedEmbeddingBagCollection 'ebc'.state_dict(): the module is sharded, so its state dict would hold "
            "only this rank's shards"
        )
        assert "trainer.strategy.full_state_dict() on every rank" in r["state_dict"]
    first, second = results
    assert second["forward"].startswith(
        "ShardedEmbeddingBagCollection 'ebc' was called outside trainer.fit/validate/test/predict. Its forward is "
        "collective"
    )
    assert second["seconds"] < 1.0
    plain = Rec()
    plain.load_state_dict(first["full"])
    with torch.no_grad():
        for r in results:
            torch.testing.assert_close(r["pred"], plain(r["batch"]), **TOL)
        torch.testing.assert_close(first["alone"], plain(first["batch"]), **TOL)


# --- 6: uneven batch counts (strict mode, uneven_batches="error"; the default pads: test_uneven_batches.py) ---
class _Batches(torch.utils.data.IterableDataset):
    """A per-rank stream of batches (no length), as a sharded-file reader deals them."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def fit_uneven(rank, world, counts, max_steps, epochs, pipeline=False):
    from lightning_shardrec.errors import UnevenBatchesError

    external_launch(rank, world)
    dm = data(4, max(counts))
    dm.setup("fit")
    batches = [dm.datasets["train"].batch(i) for i in range(counts[rank])]
    loader = torch.utils.data.DataLoader(_Batches(batches), batch_size=None)
    strict = strategy(pipeline=pipeline, uneven_batches="error")  # the opt-in strict mode (default: pad)
    t = trainer(strategy=strict, devices=world, max_steps=max_steps, max_epochs=epochs)
    error = None
    try:
        t.fit(Rec(), loader)
    except UnevenBatchesError as e:
        error = str(e)
    full_state(t)  # collective: every rank left fit at the same point, nothing hangs
    return error, t.global_step


@pytest.mark.parametrize("pipeline", [False, True])
def test_uneven_batch_counts_stop_every_rank_by_name(pipeline):
    results = run_ranks(fit_uneven, 3, [3, 2, 2], -1, 1, pipeline, timeout=120)
    for rank, (msg, step) in enumerate(results):
        assert msg == (
            f"rank {rank}: uneven batch counts: the training data of ranks [1, 2] ends after 2 batches in epoch 0, "
            "while ranks [0] have more (batch 2 is next). Every rank must run the same number of batches: deal each "
            "rank an equal count (drop or pad the remainder), or use a sized dataset and Lightning's "
            "DistributedSampler; stopping all ranks"
        )
        # stopped at the last batch they share (pipeline: rank 0 finds out one update later)
        assert step == (2 if pipeline and rank == 0 else 1)
    # a limit that every rank reaches first is no error: 2/3 batches with max_steps=2 trains 2 steps
    assert run_ranks(fit_uneven, 2, [2, 3], 2, 1, pipeline) == [(None, 2), (None, 2)]


def validate_uneven(rank, world, counts):
    from lightning_shardrec.errors import UnevenBatchesError

    external_launch(rank, world)
    dm = data(4, 1, val_batches=max(counts))
    dm.setup("validate")
    batches = [dm.datasets["val"].batch(i) for i in range(counts[rank])]
    t = trainer(strategy=strategy(), devices=world)
    try:
        t.validate(Rec(), torch.utils.data.DataLoader(_Batches(batches), batch_size=None), verbose=False)
    except UnevenBatchesError as e:
        return str(e)
    return "validated"


def test_uneven_counts_across_epochs_and_in_validation_stop_every_rank():
    for msg, _ in run_ranks(fit_uneven, 2, [2, 3], -1, 2):
        assert "uneven batch counts: the training data of ranks [0] ends after 2 batches in epoch 0" in msg
    for rank, msg in enumerate(run_ranks(validate_uneven, 2, [3, 2])):
        assert msg.startswith(
            f"rank {rank}: uneven batch counts: the validation data of ranks [1] ends after 2 batches, while ranks "
            "[0] have more (batch 2 is next)"
        )


# --- 7 (and issue 22.8): shardrec checkpoints read without the strategy -----------------------------------
def fit_and_save(rank, world, path, fmt):
    external_launch(rank, world)
    t = trainer(strategy=strategy(checkpoint_format=fmt), devices=world, max_steps=2)
    t.fit(Rec(), data(4, 2, val_batches=1))
    t.save_checkpoint(path)
    return full_state(t)


def test_shardrec_checkpoints_without_the_strategy(tmp_path):
    from lightning_shardrec.errors import CheckpointError
    from lightning_shardrec.lightning import ShardRecCheckpointIO, load_from_checkpoint

    for fmt in ("sharded", "full"):
        path = str(tmp_path / f"{fmt}.ckpt")
        want = run_ranks(fit_and_save, 2, path, fmt)[0]
        loaded = load_from_checkpoint(Rec, path)  # the default format is a directory: read as a full checkpoint
        assert_same(loaded.state_dict(), want, f"load_from_checkpoint ({fmt})")
        plain = L.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            max_steps=4,
            plugins=[ShardRecCheckpointIO()],
            default_root_dir=str(tmp_path),  # its fit (full format) writes a checkpoint: not into the working dir
        )
        plain.validate(Rec(), data(8, 2, val_batches=1), ckpt_path=path, verbose=False)  # weights only: works
        if fmt == "full":  # the tables' optimizer state in the plain layout: resumes (test_full_plain_resume.py)
            plain.fit(Rec(), data(8, 4), ckpt_path=path)
            assert plain.global_step == 4
            continue
        with pytest.raises(
            CheckpointError,
            match="was written by ShardRecStrategy: its embedding tables train in a "
            r"fused optimizer .* Resume with Trainer\(strategy='shardrec'\) on any number of devices "
            r"\(devices=1 too\); .*load_from_checkpoint\(Model, path\).*convert_to_full",
        ):
            plain.fit(Rec(), data(8, 4), ckpt_path=path)
