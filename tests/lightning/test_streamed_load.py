"""``load_from_checkpoint(Model, sharded_dir)`` streams each weight into the model (issue 29 item 2).

The checkpoint's weights arrive as :class:`StoredTensor` stand-ins; ``load_state_dict`` copies each
from the files into the model one saved piece at a time. Every other use reads the weight once
(hooks that edit values, ``deepcopy``, ``torch.save``), and the results equal the plain read.
Here every weight is a stand-in (``LAZY_BYTES = 0``); the peak is measured in
``test_checkpoint_memory.py``.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from _models import Rec, data
from test_strategy_habits import assert_same, fit_and_save

from lightning_shardrec.checkpoint import read_full, sharded_state
from lightning_shardrec.checkpoint.stored_tensor import StoredTensor
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.lightning import ShardRecCheckpointIO, load_from_checkpoint
from lightning_shardrec.testing import run_ranks

TABLE = "ebc.embedding_bags.t_big.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A sharded checkpoint written by 2 ranks through the Trainer, and the trained weights."""
    path = str(tmp_path_factory.mktemp("streamed") / "sharded.ckpt")
    return path, run_ranks(fit_and_save, 2, path, "sharded")[0]


@pytest.fixture(autouse=True)
def every_weight_stored(monkeypatch) -> None:
    monkeypatch.setattr(sharded_state, "LAZY_BYTES", 0)


def test_load_from_checkpoint_copies_every_weight_from_the_files(saved, monkeypatch):
    path, want = saved
    read: list[str] = []
    stand_ins: list[StoredTensor] = []
    original_read, original_full = StoredTensor.read_into, sharded_state.read_full

    def spy_read(self, dest):
        read.append(".".join(self._path[1:]))
        assert dest.data_ptr() != 0 and type(dest) in (torch.Tensor, torch.nn.Parameter)
        return original_read(self, dest)

    def spy_full(*args, **kwargs):
        checkpoint = original_full(*args, **kwargs)
        stand_ins.extend(v for v in checkpoint["state_dict"].values() if isinstance(v, StoredTensor))
        return checkpoint

    monkeypatch.setattr(StoredTensor, "read_into", spy_read)
    monkeypatch.setattr("lightning_shardrec.lightning.checkpoints.checkpoint_io.read_full", spy_full)
    loaded = load_from_checkpoint(Rec, path)
    assert_same(loaded.state_dict(), want, "load_from_checkpoint, streamed")
    assert sorted(read) == sorted(want)  # each weight read once, straight into the model's own tensor
    assert len(stand_ins) == len(want) and all(t._value is None for t in stand_ins)  # none read into a copy


class EditsOnLoad(Rec):
    """Scales a table in ``on_load_checkpoint``: the stand-in is read once, edited, and that value loads."""

    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"][TABLE].mul_(2)


def test_hooks_that_touch_the_values_see_and_keep_them(saved):
    path, want = saved
    loaded = load_from_checkpoint(EditsOnLoad, path)
    got = loaded.state_dict()
    torch.testing.assert_close(got[TABLE], 2 * want[TABLE])
    assert_same({k: v for k, v in got.items() if k != TABLE}, {k: v for k, v in want.items() if k != TABLE}, "rest")


def test_stand_ins_behave_as_the_tensors_they_stand_for(saved, tmp_path):
    path, _ = saved
    eager = read_full(path)["state_dict"]
    lazy = read_full(path, lazy=True)["state_dict"]
    assert list(lazy) == list(eager) and all(isinstance(v, StoredTensor) for v in lazy.values())
    table = lazy[TABLE]
    assert (table.shape, table.dtype, table.device) == (eager[TABLE].shape, torch.float32, torch.device("cpu"))
    assert "StoredTensor('ebc.embedding_bags.t_big.weight'" in repr(table)
    as_double = torch.empty(table.shape, dtype=torch.float64)
    as_double.copy_(table)  # streamed, converted on the way
    torch.testing.assert_close(as_double, eager[TABLE].double())
    assert table._value is None
    torch.testing.assert_close(table.sum(1), eager[TABLE].sum(1))  # any other op: read once, kept
    torch.testing.assert_close(copy.deepcopy(lazy)[TABLE], eager[TABLE])
    torch.save(lazy, tmp_path / "plain.pt")  # written as plain tensors: loads weights-only
    assert_same(torch.load(tmp_path / "plain.pt", weights_only=True), eager, "torch.save of stand-ins")


def test_a_mismatched_model_is_refused_as_before(saved):
    path, _ = saved

    class Wider(Rec):
        def build(self):
            super().build()
            self.mlp = torch.nn.Linear(99, 1)

    with pytest.raises(RuntimeError, match=r"size mismatch for mlp\.weight: copying a param with shape"):
        load_from_checkpoint(Wider, path)


def test_a_plain_trainer_validates_from_stand_ins(saved):
    path, _ = saved
    plain = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        max_steps=4,
        plugins=[ShardRecCheckpointIO()],
    )
    plain.validate(Rec(), data(8, 2, val_batches=1), ckpt_path=path, verbose=False)
    with pytest.raises(CheckpointError, match="was written by ShardRecStrategy: its embedding tables train"):
        plain.fit(Rec(), data(8, 4), ckpt_path=path)


def test_a_piece_that_vanished_names_the_weight(saved, tmp_path):
    import shutil

    path, _ = saved
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(path, broken)
    lazy = read_full(broken, lazy=True)["state_dict"]
    for f in broken.glob("*.distcp"):
        f.write_bytes(b"")  # emptied after the directory was opened
    with pytest.raises(CheckpointError, match=rf"reading '{TABLE}' from checkpoint '{broken}' failed"):
        torch.empty(lazy[TABLE].shape).copy_(lazy[TABLE])


def test_load_from_checkpoint_takes_lightnings_arguments(saved, tmp_path):
    path, want = saved
    loaded = load_from_checkpoint(Rec, path, map_location="cpu", strict=True, lr=0.5)  # kwargs win over hparams
    assert loaded.lr == 0.5
    assert_same(loaded.state_dict(), want, "load_from_checkpoint with arguments")
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("optimizer: sgd\n")
    assert load_from_checkpoint(Rec, path, hparams_file=hparams).optimizer == "sgd"
    with pytest.raises(ValueError, match=r"hparams_file must end in \.csv, \.yml or \.yaml, got '.*hparams\.txt'"):
        load_from_checkpoint(Rec, path, hparams_file=tmp_path / "hparams.txt")


def test_the_fallback_for_a_lightning_without_load_state_builds_the_same_model(saved):
    from lightning_shardrec.lightning.pl_compat import _load_state_fallback

    path, want = saved
    loaded = _load_state_fallback(Rec, read_full(path, lazy=True), None, lr=0.25)
    assert loaded.lr == 0.25
    assert_same(loaded.state_dict(), want, "fallback")
