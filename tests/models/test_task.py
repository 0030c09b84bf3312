"""DLRMTask: sharded on 2 ranks it trains like one device, logs its metrics, and its
checkpoint rebuilds the model with ``load_from_checkpoint``; every error message."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_shardrec import SyntheticRecDataModule
from lightning_shardrec.checkpoint import convert_to_full
from lightning_shardrec.models import DLRMTask
from lightning_shardrec.testing import run_ranks

STEPS = 3
BATCH = 8  # per rank
TOL = {"rtol": 1e-5, "atol": 1e-6}
ARCH = {
    "dlrm": {"arch": "dlrm", "interaction": "dot"},
    "dcn": {"arch": "dcn", "dcn_num_layers": 2, "dcn_low_rank_dim": 4},
}


def task(arch: str, **kw) -> DLRMTask:
    sizes = {"dense_arch_layer_sizes": [8, 4], "over_arch_layer_sizes": [8, 1]}
    return DLRMTask(embedding_dim=4, num_dense=3, **sizes, **ARCH[arch], **kw)


def data(batch_size: int, **kw) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(
        num_dense=3,
        tables=[{"name": "a", "num_embeddings": 50}, {"name": "b", "num_embeddings": 7}],
        batch_size=batch_size, num_batches=STEPS, val_batches=2, pooling_factor=2.0, **kw,
    )


def trainer(**kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def fit_sharded(rank, world, arch, ckpt):
    import lightning_shardrec  # noqa: F401

    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    t = trainer(strategy="shardrec", devices=world)
    model = task(arch)
    t.fit(model, data(BATCH))
    t.save_checkpoint(ckpt)
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    return {k: v.clone() for k, v in t.strategy.full_state_dict().items()}, metrics


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_sharded_task_matches_single_device_and_checkpoint_rebuilds(arch, tmp_path):
    ckpt = str(tmp_path / "task.ckpt")  # a sharded (DCP) checkpoint directory
    (state, metrics), _ = run_ranks(fit_sharded, 2, arch, ckpt)
    want = task(arch)
    trainer(devices=1).fit(want, data(2 * BATCH))
    for k, v in want.state_dict().items():
        torch.testing.assert_close(state[k], v, **TOL, msg=f"{arch}: {k}")
    assert {"train_loss_step", "train_auroc_step", "train_ne_step", "val_auroc", "val_ne", "val_calibration",
            "val_loss"} <= set(metrics)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    convert_to_full(ckpt, tmp_path / "full.ckpt")
    loaded = DLRMTask.load_from_checkpoint(tmp_path / "full.ckpt")  # tables came from the datamodule, kept in hparams
    assert loaded.hparams.embedding_tables[0] == {"name": "t_a", "num_embeddings": 50, "embedding_dim": 4,
                                        "feature_names": ["a"], "pooling": "SUM"}
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, state[k], msg=k)
    if arch == "dlrm":  # `shardrec export` reads the sharded directory directly
        from lightning_shardrec.cli import main
        from lightning_shardrec.inference.export import load

        out = tmp_path / "model.pt"
        with pytest.raises(SystemExit) as done:
            main(["export", "--ckpt", ckpt, "--model", "lightning_shardrec.models.task:DLRMTask",
                  "--dtype", "int8", "--out", str(out)])
        assert done.value.code == 0
        served = load(out)
        dm = data(4)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        with torch.no_grad():
            got, want_logits = served(batch), loaded.eval()(batch)
        assert got.shape == want_logits.shape == (4,)
        torch.testing.assert_close(got, want_logits, rtol=0, atol=0.05)  # int8 tables: small, bounded error
        assert not torch.equal(got, want_logits)  # it really is the quantized model


def test_task_errors():
    with pytest.raises(ValueError, match=r"unknown DLRMTask arch 'dcnv3'; available: dlrm, dcn"):
        DLRMTask(arch="dcnv3")
    with pytest.raises(ValueError, match=r"unknown DLRMTask optimizer 'lamb'; available: adagrad, sgd, adam, adamw"):
        DLRMTask(optimizer="lamb")
    with pytest.raises(ValueError, match=r"needs name and num_embeddings; optional keys: .*\(unknown: \['rows'\]\)"):
        DLRMTask(embedding_tables=[{"name": "a", "rows": 3}])
    with pytest.raises(ValueError, match=r"unknown pooling of table 'a' 'max'; available: SUM, MEAN"):
        DLRMTask(embedding_tables=[{"name": "a", "num_embeddings": 3, "pooling": "max"}])
    lonely = DLRMTask()
    with pytest.raises(ValueError, match=r"DLRMTask: the model is built in configure_model\(\)"):
        lonely(None)
    with pytest.raises(ValueError, match=r"DLRMTask: no tables: pass embedding_tables=.* got NoneType"):
        lonely.configure_model()
    with pytest.raises(ValueError, match=r"DLRMTask\(num_dense=13\) does not match the datamodule's num_dense=3"):
        trainer(devices=1).fit(DLRMTask(), data(4))


def test_explicit_tables_build_at_init_and_predict():
    model = DLRMTask(embedding_tables=[{"name": "t_a", "num_embeddings": 50, "feature_names": ["a"]},
                             {"name": "t_b", "num_embeddings": 7, "feature_names": ["b"], "pooling": "mean"}],
                     embedding_dim=4, num_dense=3)
    dm = data(4)
    dm.setup("predict")
    batch = next(iter(dm.datasets["val"]))
    probs = model.predict_step(batch, 0)
    assert probs.shape == (4,) and bool(((probs > 0) & (probs < 1)).all())
