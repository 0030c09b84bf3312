"""Trained on 2 ranks, saved as sharded checkpoints, exported as pt2 / AOTInductor programs and
served in a fresh process without the model code: a DLRM task, a plain-nn.Embedding two-tower, a
dynamic-table model. The programs equal the eager quantized models (the state-format artifact)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from test_dynamic_monitor import DynRec, _data_for
from test_plain_modules import TwoTower, batches

from lightning_shardrec import SyntheticRecDataModule
from lightning_shardrec.inference import load
from lightning_shardrec.inference.export import export, main
from lightning_shardrec.inference.program import plain_inputs, read_metadata
from lightning_shardrec.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "inference"))
from _fresh_serve import serve_fresh  # noqa: E402

TASK = dict(embedding_dim=4, num_dense=3, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1])


def _dlrm_data(batch_size: int = 8) -> SyntheticRecDataModule:
    return SyntheticRecDataModule(num_dense=3, tables=[{"name": "a", "num_embeddings": 50},
                                  {"name": "b", "num_embeddings": 7}], batch_size=batch_size, num_batches=4,
                                  val_batches=0, test_batches=2, pooling_factor=2.0, seed=5)  # fmt: skip


def _fit_three(rank: int, world: int, root: str) -> None:
    """DLRMTask, TwoTower and DynRec fitted under shardrec, each saved as a sharded checkpoint."""
    from _models import external_launch

    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.models import DLRMTask

    external_launch(rank, world)

    def trainer(steps: int) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=world, strategy=ShardRecStrategy(heartbeat_timeout=None),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=steps, use_distributed_sampler=False)  # fmt: skip

    t = trainer(4)
    t.fit(DLRMTask(**TASK), _dlrm_data())
    t.save_checkpoint(f"{root}/dlrm")
    lo, hi = rank * 12 // world, (rank + 1) * 12 // world
    t = trainer(4)
    t.fit(TwoTower(), torch.utils.data.DataLoader(batches(lo, hi), batch_size=None))
    t.save_checkpoint(f"{root}/tower")
    t = trainer(6)
    t.fit(DynRec(), _data_for(8))
    t.save_checkpoint(f"{root}/dyn")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    run_ranks(_fit_three, 2, str(root), timeout=600)
    return root


def tower_example() -> tuple:
    """``--example`` for the two-tower model: its positional inputs."""
    return batches(0, 12)[0][:3]


def _test_batches(dm: SyntheticRecDataModule) -> list:
    dm.setup("test")
    return list(dm.test_dataloader())


def _check(jobs: list[tuple[Path, str, torch.nn.Module, list[tuple]]], tmp: Path) -> None:
    """Each ``(artifact, format, eager model, inputs)``: served in one fresh process, equal to the eager model."""
    served = serve_fresh([(a, fmt, [plain_inputs(x) for x in inputs]) for a, fmt, _, inputs in jobs], tmp)
    with torch.no_grad():
        for (artifact, _, eager, inputs), outs in zip(jobs, served, strict=True):
            for args, got in zip(inputs, outs, strict=True):
                torch.testing.assert_close(
                    got, eager(*args), rtol=1e-6, atol=1e-6, msg=lambda m, a=artifact: f"{a}: {m}"
                )


def _tower_inputs() -> list[tuple]:
    out = [b[:3] for b in batches(0, 12)]
    ids, offsets, items, _ = batches(0, 1)[0]
    return [*out, (ids, offsets, items)]  # batch 1


def test_dlrm_two_tower_and_dynamic_export_pt2_and_serve_fresh(trained, tmp_path):
    # DLRM task: default example (a RecBatch), int8 rows, the sharded checkpoint of 2 ranks
    assert main(["--ckpt", str(trained / "dlrm"), "--model", "lightning_shardrec.models:DLRMTask", "--dtype", "int8",
                 "--format", "pt2", "--out", str(tmp_path / "dlrm.pt2")]) == 0  # fmt: skip
    export(trained / "dlrm", "lightning_shardrec.models:DLRMTask", "int8", tmp_path / "dlrm.pt")
    dlrm = load(tmp_path / "dlrm.pt", backend="torch")
    assert read_metadata(tmp_path / "dlrm.pt2")["inputs"] == [{"kind": "batch", "keys": ["a", "b"], "weighted": False}]
    # two-tower on plain nn.EmbeddingBag / nn.Embedding, int4 rows
    assert main(["--ckpt", str(trained / "tower"), "--model", "test_plain_modules:TwoTower", "--dtype", "int4",
                 "--format", "pt2", "--example", "test_serving_export:tower_example",
                 "--out", str(tmp_path / "tower.pt2")]) == 0  # fmt: skip
    export(trained / "tower", "test_plain_modules:TwoTower", "int4", tmp_path / "tower.pt")
    # a dynamic table: raw ids through its frozen id map (the eager model's compiled bucket loop, the
    # program's binary search in sorted ids)
    dm = _data_for(16)
    dm.setup("fit")
    dyn_inputs = [(b,) for b in dm.train_dataloader()]
    export(trained / "dyn", "test_dynamic_monitor:DynRec", "int8", tmp_path / "dyn.pt2", factory_kwargs={},
           format="pt2", example_inputs=dyn_inputs[0])  # fmt: skip
    export(trained / "dyn", "test_dynamic_monitor:DynRec", "int8", tmp_path / "dyn.pt", factory_kwargs={})
    table = read_metadata(tmp_path / "dyn.pt2")["collections"]["ebc"]["tables"][0]
    assert table["name"] == "t_user" and table["dynamic"]["eviction"] == "lru"
    _check(
        [(tmp_path / "dlrm.pt2", "pt2", dlrm, [(b,) for b in _test_batches(_dlrm_data(batch_size=5))]),
         (tmp_path / "tower.pt2", "pt2", load(tmp_path / "tower.pt"), _tower_inputs()),
         (tmp_path / "dyn.pt2", "pt2", load(tmp_path / "dyn.pt"), dyn_inputs)],
        tmp_path,
    )  # fmt: skip


@pytest.mark.slow
def test_aoti_packages_serve_fresh(trained, tmp_path):
    """AOTInductor compiles C++ for each program (about a minute each on a loaded 2-core machine)."""
    export(trained / "dlrm", "lightning_shardrec.models:DLRMTask", "fp16", tmp_path / "dlrm_aoti.pt2", format="aoti")
    export(trained / "dlrm", "lightning_shardrec.models:DLRMTask", "fp16", tmp_path / "dlrm.pt")
    export(trained / "tower", "test_plain_modules:TwoTower", "int8", tmp_path / "tower_aoti.pt2", format="aoti",
           example_inputs=tower_example())  # fmt: skip
    export(trained / "tower", "test_plain_modules:TwoTower", "int8", tmp_path / "tower.pt")
    _check(
        [(tmp_path / "dlrm_aoti.pt2", "aoti", load(tmp_path / "dlrm.pt", backend="torch"),
          [(b,) for b in _test_batches(_dlrm_data(batch_size=5))]),
         (tmp_path / "tower_aoti.pt2", "aoti", load(tmp_path / "tower.pt"), _tower_inputs())],
        tmp_path,
    )  # fmt: skip
