"""Checkpoints: resume continues the identical run, on the same or another world size,
and the file loads into the plain (unsharded) model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.checkpoint import convert_to_full
from lightning_shardrec.testing import run_ranks

GLOBAL_BATCH = 12
STEPS = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def fit(rank, world, steps, ckpt_in, ckpt_out, sharding_type, embedding_optimizer=None, fmt="sharded"):
    import lightning_shardrec  # noqa: F401
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[sharding_type]) for f in ("big", "mid")}
    plan = None
    if embedding_optimizer:  # pin several column pieces per table (the planner keeps tiny tables whole)
        from lightning_shardrec.planner import ParameterSharding, ShardMetadata

        def pieces(rows, cuts):
            shards = [ShardMetadata((0, c), (rows, w), i % world) for i, (c, w) in enumerate(cuts)]
            return ParameterSharding("column_wise", "fused", [s.rank for s in shards], shards)

        plan = {"t_big": pieces(120, [(0, 4), (4, 4)]), "t_mid": pieces(30, [(0, 8), (8, 4)])}
    strategy = ShardRecStrategy(
        constraints=constraints, plan=plan, embedding_optimizer=embedding_optimizer, checkpoint_format=fmt
    )
    t = trainer(strategy=strategy, devices=world, max_steps=steps)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, STEPS), ckpt_path=ckpt_in)
    if ckpt_out:
        t.save_checkpoint(ckpt_out)
    pieces = {t: len(p.shards) for t, p in strategy.plan.get_plan_for_module("ebc").items()}
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return (state, pieces) if embedding_optimizer else state


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_resume_and_reshard(tmp_path, fmt):
    straight = run_ranks(fit, 2, STEPS, None, None, "row_wise")[0]
    half = str(tmp_path / "half.ckpt")
    run_ranks(fit, 2, STEPS // 2, None, half, "row_wise", None, fmt)
    assert Path(half).is_dir() == (fmt == "sharded")
    # mid-epoch: 4 steps + save + resume 4 == 8 straight, on the same and on other world sizes and plans
    for world, kind in [(2, "row_wise"), (1, "table_wise"), (3, "column_wise")]:
        resumed = run_ranks(fit, world, STEPS, half, None, kind, None, fmt)[0]
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], **TOL, msg=f"{fmt}: resume at W={world} ({kind}): {k}")
    if fmt == "full":
        check_full_file(half)
    else:
        full = str(tmp_path / "full.ckpt")
        convert_to_full(half, full)  # one process, no group: for inference and load_from_checkpoint
        plain = Rec()
        plain.load_state_dict(torch.load(full, weights_only=True)["state_dict"])  # strict: unsharded keys
        want = run_ranks(fit, 1, STEPS // 2, None, None, "row_wise")[0]
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(v, want[k], **TOL, msg=f"converted checkpoint: {k}")


def check_full_file(half):
    ckpt = torch.load(half, weights_only=True)
    plain = Rec()
    plain.load_state_dict(ckpt["state_dict"])  # strict: the keys are the unsharded model's
    assert ckpt["state_dict"]["ebc.embedding_bags.t_big.weight"].shape == (120, 8)
    fused = ckpt["shardrec_fused_optimizer"]["states"]
    assert {"ebc.embedding_bags.t_big.weight", "ebc.embedding_bags.t_mid.weight"} <= set(fused)
    assert fused["ebc.embedding_bags.t_big.weight"]["sum"].shape == (120, 8)  # adagrad state, full table


def fit_with_checkpointing(rank, world, root):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    t = trainer(
        strategy=ShardRecStrategy(), devices=world, max_steps=4, enable_checkpointing=True, default_root_dir=root
    )
    t.fit(Rec(), data(4, 4))
    return t.checkpoint_callback.best_model_path or t.checkpoint_callback.last_model_path


def test_model_checkpoint_writes_plan_beside_checkpoints(tmp_path):
    import json
    from pathlib import Path

    from lightning_shardrec import ShardingPlan

    path = run_ranks(fit_with_checkpointing, 2, str(tmp_path))[0]
    ckpt_dir = Path(path).parent
    plan = ShardingPlan.from_json((ckpt_dir / "sharding_plan.json").read_text())
    assert set(plan.get_plan_for_module("ebc")) == {"t_big", "t_mid", "t_tiny"}
    ckpt = torch.load(Path(path) / "meta.pt", weights_only=True)  # a sharded checkpoint is a directory
    assert ShardingPlan.from_json(ckpt["shardrec_plan"]) == plan
    assert json.loads(ckpt["shardrec_plan"])  # plain JSON text, loadable without this library


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_rowwise_state_of_column_pieces_survives_resume(tmp_path, fmt):
    """Row-wise adagrad keeps one value per row *per column piece*; each piece gets its own back."""
    straight, pieces = run_ranks(fit, 2, STEPS, None, None, "column_wise", "rowwise_adagrad")[0]
    assert pieces["t_big"] >= 2 and pieces["t_mid"] >= 2
    half = str(tmp_path / "half.ckpt")
    run_ranks(fit, 2, STEPS // 2, None, half, "column_wise", "rowwise_adagrad", fmt)
    resumed, _ = run_ranks(fit, 2, STEPS, half, None, "column_wise", "rowwise_adagrad", fmt)[0]
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], **TOL, msg=k)


def fit_epochs(rank, world, epochs, ckpt_in, ckpt_out):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy()
    t = trainer(strategy=strategy, devices=world, max_epochs=epochs)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, 3), ckpt_path=ckpt_in)
    if ckpt_out:
        t.save_checkpoint(ckpt_out)
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}, t.global_step


def test_resume_from_epoch_end():
    """Save after epoch 1 and resume to epoch 2 == 2 epochs straight."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        straight, steps = run_ranks(fit_epochs, 2, 2, None, None)[0]
        run_ranks(fit_epochs, 2, 1, None, f"{tmp}/epoch1.ckpt")
        resumed, resumed_steps = run_ranks(fit_epochs, 2, 2, f"{tmp}/epoch1.ckpt", None)[0]
    assert steps == resumed_steps == 6
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], **TOL, msg=k)
