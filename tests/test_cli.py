"""The ``shardrec`` CLI: the shipped configs parse; the DLRM config runs fit -> validate ->
predict on 2 ranks at tiny sizes (curves PNG, sharded checkpoint); the console script runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lightning_shardrec.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples" / "dlrm" / "config.yaml")
TINY = [
    "--data.init_args.tables=" + json.dumps([{"name": "a", "num_embeddings": 64}, {"name": "b", "num_embeddings": 9}]),
    "--data.init_args.batch_size=16",
    "--data.init_args.num_batches=4",
    "--data.init_args.val_batches=2",
    "--trainer.val_check_interval=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@pytest.mark.parametrize("name", ["config.yaml", "criteo.yaml"])
def test_shipped_configs_parse_and_build(name, tmp_path, monkeypatch):
    from lightning_shardrec import CriteoDataModule, DLRMTask, ShardRecStrategy, SyntheticRecDataModule
    from lightning_shardrec.cli import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["shardrec"])
    cli = run_cli(["--config", str(ROOT / "examples" / "dlrm" / name)], run=False)
    assert isinstance(cli.model, DLRMTask)
    assert isinstance(cli.trainer.strategy, ShardRecStrategy)
    assert isinstance(cli.datamodule, SyntheticRecDataModule if name == "config.yaml" else CriteoDataModule)
    assert [type(lg).__name__ for lg in cli.trainer.loggers][0] == "CSVLogger"
    assert any(type(c).__name__ == "TrainingCurves" for c in cli.trainer.callbacks)


def _cli_two_ranks(rank, world, root):
    from lightning_shardrec.cli import run_cli

    sys.argv = ["shardrec"]
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    common = ["--config", CONFIG, *TINY, f"--trainer.default_root_dir={root}"]
    fit = run_cli(["fit", *common])
    fit_metrics = {k: float(v) for k, v in fit.trainer.callback_metrics.items()}
    last = str(Path(fit.trainer.checkpoint_callback.dirpath) / "last.ckpt")
    val = run_cli(["validate", *common, f"--ckpt_path={last}"])
    pred = run_cli(["predict", *common, f"--ckpt_path={last}"])
    probs = [p for batch in pred.trainer.predict_loop.predictions for p in batch.tolist()] if rank == 0 else []
    return fit_metrics, {k: float(v) for k, v in val.trainer.callback_metrics.items()}, last, probs


def test_dlrm_config_fit_validate_predict_on_two_ranks(tmp_path):
    (fit, val, last, probs), _ = run_ranks(_cli_two_ranks, 2, str(tmp_path))
    assert {"val_auroc", "val_ne", "val_calibration", "train_loss_step"} <= set(fit)
    assert val["val_auroc"] == pytest.approx(fit["val_auroc"])  # the checkpoint holds the trained model
    assert Path(last).is_dir()  # a sharded (DCP) checkpoint
    version = tmp_path / "lightning_logs" / "version_0"
    assert (version / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "val_auroc" in (version / "metrics.csv").read_text().splitlines()[0]
    assert len(probs) == 2 * 16 and all(0 < p < 1 for p in probs)


def test_console_script_on_one_device(tmp_path):
    script = Path(sys.executable).with_name("shardrec")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_shardrec.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*cmd, "fit", "--config", CONFIG, *TINY, "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}",
         "--model.init_args.arch=dcn"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sharding plan" in out.stdout and "final validation: val_loss=" in out.stdout


def test_help_lists_export(monkeypatch, capsys):
    from lightning_shardrec.cli import main

    monkeypatch.setattr(sys, "argv", ["shardrec", "--help"])
    with warnings.catch_warnings(record=True) as warned, pytest.raises(SystemExit) as done:
        warnings.simplefilter("always")
        main()
    assert done.value.code == 0
    assert not [w for w in warned if "args parameter" in str(w.message)]  # no "both args and sys.argv" warning
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict}" in out and "and export, which writes a quantized serving artifact" in out
    assert "export: shardrec export --ckpt CKPT --out model.pt" in out
    assert "lightning_shardrec.inference.load" in out
