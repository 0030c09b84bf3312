"""The DataModules under a real Lightning Trainer (CPU, one process) and on their own."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_shardrec import DynamicConfig
from lightning_shardrec.data import (
    CriteoDataModule,
    RecBatch,
    RecBatchLoader,
    SyntheticRecDataModule,
)

TABLES = [
    {"name": "a", "num_embeddings": 100},
    {"name": "b", "num_embeddings": 30, "pooling_factor": 2.0},
]


class Recorder(L.LightningModule):
    """A linear model on the dense features that records a fingerprint of every batch."""

    def __init__(self, num_dense: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(num_dense, 1)
        self.seen: list[float] = []

    def training_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        assert isinstance(batch, RecBatch)
        self.seen.append(round(float(batch.dense.sum() + batch.sparse.values().sum()), 4))
        loss = nn.functional.binary_cross_entropy_with_logits(
            self.lin(batch.dense).squeeze(1), batch.labels
        )
        self.log("loss", loss)  # batch size found from the RecBatch
        return loss

    def validation_step(self, batch: RecBatch, batch_idx: int) -> None:
        self.log(
            "val_loss",
            nn.functional.binary_cross_entropy_with_logits(
                self.lin(batch.dense).squeeze(1), batch.labels
            ),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp: Path | None = None, every: int | None = None) -> L.Trainer:
    callbacks = (
        []
        if every is None
        else [ModelCheckpoint(dirpath=tmp, every_n_train_steps=every, save_top_k=-1)]
    )
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=every is not None,
        callbacks=callbacks,
    )


def _dm(num_workers: int = 0) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=3,
        tables=TABLES,
        batch_size=8,
        num_batches=5,
        val_batches=1,
        num_workers=num_workers,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_mid_epoch_checkpoints_sees_the_same_batches(
    tmp_path: Path, num_workers: int
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        straight = Recorder()
        _trainer(tmp_path, every=3).fit(straight, _dm(num_workers))
    assert len(straight.seen) == 10 and len(set(straight.seen)) == 5  # 2 epochs replay 5 batches
    bad = [
        str(w.message)
        for w in caught
        if "batch_size" in str(w.message) or "resum" in str(w.message)
    ]
    assert not bad, bad
    # step 3 and 9: mid-epoch; step 6: first batch of the second epoch
    for step in (3, 6, 9):
        (ckpt,) = tmp_path.glob(f"*step={step}.ckpt")
        resumed = Recorder()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer().fit(resumed, _dm(num_workers), ckpt_path=ckpt)
        assert resumed.seen == straight.seen[step:], step
        assert not [w for w in caught if "not resumable" in str(w.message)]
        assert torch.allclose(resumed.lin.weight, straight.lin.weight)


def test_resume_from_end_of_epoch_checkpoint(tmp_path: Path) -> None:
    straight = Recorder()
    _trainer(tmp_path, every=5).fit(straight, _dm())
    (ckpt,) = tmp_path.glob("*step=5.ckpt")
    resumed = Recorder()
    _trainer().fit(resumed, _dm(), ckpt_path=ckpt)
    assert resumed.seen == straight.seen[5:]


def test_setup_takes_rank_and_world_size_from_the_trainer() -> None:
    dm = _dm()
    dm.setup("fit")
    single = next(iter(dm.train_dataloader()))
    halves = []
    for rank in (0, 1):
        dm2 = SyntheticRecDataModule(num_dense=3, tables=TABLES, batch_size=4, num_batches=5)
        dm2.trainer = SimpleNamespace(global_rank=rank, world_size=2)  # type: ignore[assignment]
        dm2.setup("fit")
        assert dm2.rank_and_world_size() == (rank, 2)
        halves.append(next(iter(dm2.train_dataloader())))
    assert torch.equal(torch.cat([h.dense for h in halves]), single.dense)
    assert torch.equal(torch.cat([h.labels for h in halves]), single.labels)


def test_loaders_and_tables() -> None:
    dm = SyntheticRecDataModule(
        num_dense=3, tables=TABLES, batch_size=4, num_batches=2, val_batches=0
    )
    with pytest.raises(ValueError, match="call setup\\(\\) before asking for the train dataloader"):
        dm.train_dataloader()
    dm.setup("fit")
    assert isinstance(dm.train_dataloader(), RecBatchLoader)
    assert dm.val_dataloader() == []
    assert [t.feature_names for t in dm.embedding_tables(8)] == [["a"], ["b"]]
    assert len(SyntheticRecDataModule().features) == 8  # the benchmark workload by default


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "SyntheticRecDataModule: batch_size must be an int >= 1, got 0"),
        ({"num_workers": -1}, "SyntheticRecDataModule: num_workers must be an int >= 0, got -1"),
        ({"num_batches": -2}, "SyntheticRecDataModule: num_batches must be an int >= 0, got -2"),
        ({"val_batches": 1.5}, "SyntheticRecDataModule: val_batches must be an int >= 0, got 1.5"),
    ],
)
def test_synthetic_datamodule_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticRecDataModule(**kwargs)


def test_criteo_datamodule_trains(criteo_day_dir: Path) -> None:
    dm = CriteoDataModule(
        criteo_day_dir,
        num_embeddings=1000,
        batch_size=16,
        val_fraction=0.1,
        test_fraction=0.1,
        on_bad_line="skip",
    )
    model = Recorder(num_dense=13)
    _trainer().fit(model, dm)
    # 500 rows -> 400 train rows -> 25 batches of 16 per epoch
    assert len(model.seen) == 50 and dm.bad_lines == 0
    assert (criteo_day_dir / "processed" / "meta.json").is_file()
    assert [t.num_embeddings for t in dm.embedding_tables(4)] == [1000] * 26


def test_criteo_datamodule_errors(criteo_day_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_bad_line must be one of error, skip; got 'warn'"):
        CriteoDataModule(criteo_day_dir, on_bad_line="warn")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match="val_fraction 0.6 and test_fraction 0.5 must be >= 0 and sum to less than 1",
    ):
        CriteoDataModule(criteo_day_dir, val_fraction=0.6, test_fraction=0.5)
    dm = CriteoDataModule(criteo_day_dir, num_embeddings=1000)
    with pytest.raises(ValueError, match="has no meta.json; run preprocess_criteo first"):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"bad_lines is known after setup\(\)"):
        _ = dm.bad_lines
    dm.prepare_data()
    other = CriteoDataModule(criteo_day_dir, num_embeddings=999)
    with pytest.raises(
        ValueError, match=r"was hashed with num_embeddings \[1000, .*\], not \[999, "
    ):
        other.setup("fit")
    raw = CriteoDataModule(criteo_day_dir, num_embeddings=1000, raw_ids=True)
    with pytest.raises(
        ValueError, match=r"processed_dir '.*processed' holds hashed ids, not raw_ids=True; delete it or use another"
    ):
        raw.setup("fit")
    assert all(t.dynamic == DynamicConfig() for t in raw.embedding_tables(8))
    assert all(t.dynamic is None for t in dm.embedding_tables(8))
