"""Checkpoints: resume continues the identical run, on the same or another world size,
and the file loads into the plain (unsharded) model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from _models import TABLES, Rec, data, external_launch, trainer

from lightning_shardrec.checkpoint import convert_to_full, plain_table_states
from lightning_shardrec.testing import run_ranks

GLOBAL_BATCH = 12
STEPS = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def fit(rank, world, steps, ckpt_in, ckpt_out, sharding_type, embedding_optimizer=None, fmt="sharded", kernel="auto"):
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
        constraints=constraints,
        plan=plan,
        embedding_optimizer=embedding_optimizer,
        checkpoint_format=fmt,
        kernel=kernel,
    )
    t = trainer(strategy=strategy, devices=world, max_steps=steps)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, STEPS), ckpt_path=ckpt_in)
    if kernel != "auto":
        assert {k.backend.value for s in strategy.sharded.values() for k in s.kernels()} == {kernel}
    if ckpt_out:
        t.save_checkpoint(ckpt_out)
    pieces = {t: len(p.shards) for t, p in strategy.plan.get_plan_for_module("ebc").items()}
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return (state, pieces) if embedding_optimizer else state


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_resume_and_reshard(tmp_path, valid_zip, fmt):
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
        valid_zip(half)  # an ordinary zip archive: every record's CRC-32 checks, the tables' too
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
    entry = ckpt["shardrec_fused_optimizer"]
    assert entry["layout"] == "plain" and entry["states"] == {}  # the tables' state where a plain run keeps it
    fused = plain_table_states(ckpt["optimizer_states"], entry["positions"])
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


@pytest.mark.needs_fbgemm
def test_rowwise_checkpoint_moves_from_fbgemm_to_the_torch_kernel(tmp_path):
    """A checkpoint trained on fbgemm's TBE (kernel="auto" on CPU before the torch kernel became
    the faster rowwise_adagrad) resumes on the torch kernel as if it had run there throughout."""
    straight, _ = run_ranks(fit, 2, STEPS, None, None, "column_wise", "rowwise_adagrad", "sharded", "torch")[0]
    half = str(tmp_path / "half.ckpt")
    run_ranks(fit, 2, STEPS // 2, None, half, "column_wise", "rowwise_adagrad", "sharded", "fbgemm")
    resumed, _ = run_ranks(fit, 2, STEPS, half, None, "column_wise", "rowwise_adagrad", "sharded", "auto")[0]
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


# --- faults: a save that fails or dies half-way; a foreign or malicious checkpoint -----------------

FAULT_STEP = 3


class StartStep(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def checkpointing(root, fmt, save_last, world):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    row_wise = {f"t_{f}": ParameterConstraints(sharding_types=["row_wise"]) for f in ("big", "mid")}
    every_step = ModelCheckpoint(
        dirpath=root, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=save_last
    )
    strategy = ShardRecStrategy(constraints=row_wise, checkpoint_format=fmt)
    start = StartStep()
    t = trainer(strategy=strategy, devices=world, max_steps=4, enable_checkpointing=True, callbacks=[every_step, start])
    return t, strategy, start


def fail_one_save(t, rank, fmt, target):
    """Patch the writer: the save of ``target`` at step FAULT_STEP writes part of its data, then fails."""
    from torch.distributed.checkpoint import FileSystemWriter

    if fmt == "sharded":  # rank 1's shard file is written, then its disk "fills up"
        write = FileSystemWriter.write_data

        def failing(self, plan, planner):
            future = write(self, plan, planner)
            if rank == 1 and t.global_step == FAULT_STEP and target in Path(self.path).name:
                raise OSError("injected: no space left on device")
            return future

        FileSystemWriter.write_data = failing
        return lambda: setattr(FileSystemWriter, "write_data", write)
    from lightning_shardrec.checkpoint.streamed_file import StreamedFile

    fill = StreamedFile.fill

    def failing_fill(self, stored, first, values):  # rank 0 writes its first rows, then fails
        self.fills = getattr(self, "fills", 0) + 1
        if t.global_step == FAULT_STEP and target in Path(self.name).name and self.fills > 1:
            raise OSError("injected: no space left on device")
        return fill(self, stored, first, values)

    StreamedFile.fill = failing_fill
    return lambda: setattr(StreamedFile, "fill", fill)


def crash_in_save_then_resume(rank, world, root, fmt, save_last, target):
    from lightning_shardrec.errors import CheckpointError

    external_launch(rank, world)
    t, _, _ = checkpointing(root, fmt, save_last, world)
    undo = fail_one_save(t, rank, fmt, target)
    try:
        t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, STEPS))
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        undo()
    last = Path(root) / "last.ckpt"
    listing = sorted(os.listdir(root)) + ([f"last.ckpt -> {os.readlink(last)}"] if last.is_symlink() else [])
    t, strategy, start = checkpointing(root, fmt, save_last, world)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, STEPS), ckpt_path="last")
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return error, listing, start.step, state, sorted(os.listdir(root))


@pytest.mark.parametrize(
    ("fmt", "save_last", "target", "kept"),
    [
        ("sharded", True, "last", ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]),
        (
            "sharded",
            "link",
            "step=3",
            ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt", "last.ckpt -> epoch=0-step=2.ckpt"],
        ),
        ("full", True, "last", ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]),
    ],
)
def test_failed_save_keeps_last_loadable(tmp_path, fmt, save_last, target, kept):
    """Step 3's save fails half-written on one rank: every rank raises, ``last`` still holds step 2
    (a whole checkpoint, or a link to one), and ``fit(ckpt_path="last")`` continues the run exactly."""
    straight = run_ranks(fit, 2, 4, None, None, "row_wise")[0]
    results = run_ranks(crash_in_save_then_resume, 2, str(tmp_path), fmt, save_last, target)
    for error, listing, resumed_from, state, after in results:
        assert error is not None and "injected: no space left on device" in error and "untouched" in error
        assert sorted(listing) == sorted([*kept, "sharding_plan.json"])  # top-2 kept, the rest removed, no staging
        assert resumed_from == 2
        for k in straight:
            torch.testing.assert_close(state[k], straight[k], **TOL, msg=k)
        assert not [p for p in after if p.startswith(".")]


def killed_mid_save(root):
    """Run in a fresh process (1 rank): killed (no cleanup, no handlers) while writing step 3's ``last``."""
    from torch.distributed.checkpoint import FileSystemWriter

    import lightning_shardrec  # noqa: F401

    t, _, _ = checkpointing(root, "sharded", True, 1)
    write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = write(self, plan, planner)
        if t.global_step == FAULT_STEP and "last" in Path(self.path).name:
            os._exit(9)
        return future

    FileSystemWriter.write_data = write_then_die
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH, STEPS))


def resume_last(rank, world, root):
    external_launch(rank, world)
    t, strategy, start = checkpointing(root, "sharded", True, world)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, STEPS), ckpt_path="last")
    return start.step, {k: v.clone() for k, v in strategy.full_state_dict().items()}


def test_killed_during_save_keeps_last_loadable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_strategy_checkpoint as m; "
    code += f"m.killed_mid_save({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-3000:]
    stale = [p for p in os.listdir(tmp_path) if p.startswith(".last.ckpt.tmp-")]
    assert len(stale) == 1 and (tmp_path / "last.ckpt" / "meta.pt").exists()  # the half write sits beside it
    resumed_from, state = run_ranks(resume_last, 2, str(tmp_path))[0]  # and on another world size
    assert resumed_from == 2
    straight = run_ranks(fit, 2, 4, None, None, "row_wise")[0]
    for k in straight:
        torch.testing.assert_close(state[k], straight[k], **TOL, msg=k)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # the next save of last.ckpt cleaned up


class Narrow(Rec):
    """``Rec`` whose ``t_big`` table is 6 wide instead of 8 (and its MLP to match)."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig

        tables = [(f, n, 6 if f == "big" else d, p) for f, n, d, p in TABLES]
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name=f"t_{f}", embedding_dim=d, num_embeddings=n, feature_names=[f], pooling=p)
                for f, n, d, p in tables
            ]
        )
        self.mlp = torch.nn.Linear(3 + sum(d for _, _, d, _ in tables), 1)


def load_foreign(rank, world, ckpt, model_cls):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.errors import CheckpointError

    external_launch(rank, world)
    model = {"Narrow": Narrow, "Rec": Rec}[model_cls]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = ShardRecStrategy()
    try:
        trainer(strategy=strategy, devices=world, max_steps=STEPS).fit(
            model, data(GLOBAL_BATCH // world, STEPS), ckpt_path=ckpt
        )
        return "loaded", False
    except CheckpointError as e:
        after = strategy.full_state_dict()
        return str(e), all(torch.equal(after[k], v) for k, v in before.items())


class Payload:
    """Unpickling this creates ``marker``: stands for any code a stranger's checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_foreign_or_malicious_checkpoint_is_refused_before_loading(tmp_path, fmt):
    ckpt = str(tmp_path / "rec.ckpt")
    run_ranks(fit, 2, 2, None, ckpt, "row_wise", None, fmt)
    results = run_ranks(load_foreign, 2, ckpt, "Narrow")
    for message, untouched in results:
        assert "nothing was loaded" in message
        assert "'ebc.embedding_bags.t_big.weight': checkpoint has shape (120, 8), model expects (120, 6)" in message
        assert "'mlp.weight': checkpoint has shape (1, 27), model expects (1, 25)" in message
        assert untouched  # t_mid, t_tiny and the rest fit, yet nothing was copied
    marker = tmp_path / "pwned"
    if fmt == "full":
        evil = torch.load(ckpt, weights_only=True)
        evil["callbacks"] = {"x": Payload(marker)}
        torch.save(evil, ckpt)
    else:
        meta = torch.load(Path(ckpt) / "meta.pt", weights_only=True)
        torch.save({**meta, "loops": Payload(marker)}, Path(ckpt) / "meta.pt")
    for message, _ in run_ranks(load_foreign, 2, ckpt, "Rec"):
        assert "holds objects other than tensors and plain containers; refusing to load it" in message
    assert not marker.exists()
