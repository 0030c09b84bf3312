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


@pytest.mark.parametrize("name", ["config.yaml", "criteo.yaml", "criteo_dynamic.yaml"])
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
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
    )
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
        [
            *cmd,
            "fit",
            "--config",
            CONFIG,
            *TINY,
            "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.arch=dcn",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
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


def _criteo_rows(path: Path, n: int) -> None:
    """``n`` Criteo-format lines (label, 13 ints with blanks, 26 hex ids) in ``path``."""
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(n):
        dense = ["" if rng.random() < 0.2 else str(rng.randint(0, 500)) for _ in range(13)]
        cats = [f"{rng.getrandbits(32):08x}" for _ in range(26)]
        rows.append("\t".join([str(rng.randint(0, 1)), *dense, *cats]))
    path.write_text("\n".join(rows) + "\n")


STRATEGY_CLASS_PATH = "lightning_shardrec.ShardRecStrategy"
# Both shipped configs, strategy in the class-path form with init_args (criteo.yaml has it already;
# the override adds init_args so the expanded-**kwargs crash of DDP's constructor would show on each).
CLASS_PATH_RUNS = {
    "config.yaml": [
        *TINY,
        "--trainer.strategy=" + json.dumps({"class_path": STRATEGY_CLASS_PATH, "init_args": {"pipeline": False}}),
    ],
    "criteo_dynamic.yaml": [
        "--trainer.strategy.init_args.pipeline=false",
        "--data.init_args.num_embeddings=64",
        "--data.init_args.batch_size=8",
        "--data.init_args.val_fraction=0.1",
        "--data.init_args.test_fraction=0.1",
        "--model.init_args.embedding_dim=8",
        "--model.init_args.dense_arch_layer_sizes=[16, 8]",
        "--model.init_args.over_arch_layer_sizes=[16, 1]",
    ],
    "criteo.yaml": [
        "--trainer.strategy.init_args.pipeline=false",
        "--data.init_args.num_embeddings=50",
        "--data.init_args.batch_size=8",
        "--data.init_args.val_fraction=0.1",
        "--data.init_args.test_fraction=0.1",
        "--model.init_args.embedding_dim=8",
        "--model.init_args.dense_arch_layer_sizes=[16, 8]",
        "--model.init_args.over_arch_layer_sizes=[16, 1]",
    ],
}


def _cli_class_path_fit(rank, world, root, name):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.cli import run_cli

    sys.argv = ["shardrec"]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
    )
    args = [
        "fit",
        "--config",
        str(ROOT / "examples" / "dlrm" / name),
        *CLASS_PATH_RUNS[name],
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}",
    ]
    if name.startswith("criteo"):
        args += [f"--data.init_args.data_dir={root}/criteo", f"--data.init_args.processed_dir={root}/processed"]
    cli = run_cli(args)
    strategy = cli.trainer.strategy
    assert type(strategy) is ShardRecStrategy and strategy.sharded
    return cli.trainer.global_step, sorted(strategy._ddp_kwargs)


@pytest.mark.parametrize("name", sorted(CLASS_PATH_RUNS))
def test_shipped_configs_train_with_the_strategy_by_class_path(name, tmp_path):
    if name.startswith("criteo"):
        (tmp_path / "criteo").mkdir()
        _criteo_rows(tmp_path / "criteo" / "day_0", 200)
    results = run_ranks(_cli_class_path_fit, 2, str(tmp_path), name)
    for steps, ddp_kwargs in results:
        assert steps == 2
        assert ddp_kwargs == ["find_unused_parameters", "gradient_as_bucket_view", "static_graph"]


def test_print_config_lists_only_the_strategys_options(tmp_path, capsys, monkeypatch):
    import inspect

    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.cli import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["shardrec"])
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(ROOT / "examples" / "dlrm" / "criteo.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    block = printed.split("init_args:\n", 1)[1].split("\n  devices:", 1)[0]
    keys = [line.split(":")[0].strip() for line in block.splitlines()]
    assert keys == [p for p in inspect.signature(ShardRecStrategy).parameters]
    from torch.nn.parallel import DistributedDataParallel

    ddp_args = set(inspect.signature(DistributedDataParallel).parameters) & set(keys)
    assert ddp_args == {"find_unused_parameters", "static_graph", "gradient_as_bucket_view"}  # not process_group...


def test_criteo_dynamic_config_trains_unsharded_on_raw_ids(tmp_path, monkeypatch):
    from lightning_shardrec.cli import run_cli
    from lightning_shardrec.modules import EmbeddingBagCollection

    (tmp_path / "criteo").mkdir()
    _criteo_rows(tmp_path / "criteo" / "day_0", 120)
    monkeypatch.setattr(sys, "argv", ["shardrec"])
    args = [
        "fit", "--config", str(ROOT / "examples" / "dlrm" / "criteo_dynamic.yaml"),
        *CLASS_PATH_RUNS["criteo_dynamic.yaml"][1:],
        "--trainer.strategy=auto", "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}",
        f"--data.init_args.data_dir={tmp_path}/criteo", f"--data.init_args.processed_dir={tmp_path}/processed",
    ]  # fmt: skip
    cli = run_cli(args)
    assert cli.trainer.global_step == 2
    ebc = next(m for m in cli.model.modules() if isinstance(m, EmbeddingBagCollection))
    tables = ebc.embedding_bag_configs()
    assert len(tables) == 26 and all(t.dynamic is not None and t.dynamic.min_count == 2 for t in tables)
    stats = ebc.dynamic_stats()["t_cat_0"]
    # 16 random 32-bit ids per step, none seen twice: all wait in the candidate tables (min_count 2)
    assert (stats["admissions"], stats["misses"], stats["candidates"]) == (0, 16, 16)
    batch = next(iter(cli.datamodule.train_dataloader()))
    assert int(batch.sparse.values().max()) >= 2**31 > 64  # raw hex values, not hashed into 64 rows
    specs = cli.model.hparams["embedding_tables"]
    assert specs[0]["dynamic"] == {"eviction": "lru", "ttl_steps": 20000, "min_count": 2, "num_buckets": None,
                                   "candidates_per_bucket": None, "seed": 0}  # fmt: skip


# --- issue 44 (item 7): a module of the working directory; one tower of a two-tower model ---------------------
TOWERS = """
from torch import nn


class ItemTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.item = nn.EmbeddingBag(50, 8, mode="sum")
        self.proj = nn.Linear(8, 4)


class UserTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.EmbeddingBag(30, 8, mode="sum")


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_tower, self.item_tower, self.other_items = UserTower(), ItemTower(), ItemTower()
"""


def _towers(tmp_path, monkeypatch):
    import torch

    (tmp_path / "towers.py").write_text(TOWERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import towers

    model = towers.TwoTower()
    torch.save(model.state_dict(), tmp_path / "full.pt")
    return model


def test_export_of_one_tower_from_a_module_in_the_working_directory(tmp_path, monkeypatch):
    """``shardrec export`` from the directory holding the model's module (no PYTHONPATH=.), of one tower."""
    import torch

    model = _towers(tmp_path, monkeypatch)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout, not the cwd
    run = ["-c", "from lightning_shardrec.cli import main; main()", "export", "--ckpt", "full.pt"]
    run += ["--model", "towers:ItemTower", "--submodule", "item_tower", "--out", "item.pt"]
    done = subprocess.run([sys.executable, "-P", *run], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    artifact = torch.load(tmp_path / "item.pt", weights_only=True)
    assert artifact["factory"] == "towers:ItemTower"
    torch.testing.assert_close(artifact["state_dict"]["proj.weight"], model.item_tower.proj.weight)


def test_export_of_a_sub_module_finds_its_prefix_or_asks_for_it(tmp_path, monkeypatch):
    from lightning_shardrec.errors import CheckpointError
    from lightning_shardrec.inference.export import export

    _towers(tmp_path, monkeypatch)
    user = export(tmp_path / "full.pt", "towers:UserTower", "int8", tmp_path / "user.pt")  # one prefix fits
    assert [n for n, _ in user.named_children()] == ["user"]
    with pytest.raises(
        CheckpointError,
        match=r"holds more than towers:ItemTower .* name the part with --submodule "
        r"\(shardrec export\) or submodule= \(export\(\)\): candidates \['item_tower', 'other_items'\]",
    ):
        export(tmp_path / "full.pt", "towers:ItemTower", "int8", tmp_path / "item.pt")
    with pytest.raises(CheckpointError, match=r"has no entries under 'items\.'; its top-level modules: \['item_tower'"):
        export(tmp_path / "full.pt", "towers:ItemTower", "int8", tmp_path / "item.pt", submodule="items")
    export(tmp_path / "full.pt", "towers:ItemTower", "int8", tmp_path / "item.pt", submodule="other_items")
