"""The examples end to end at tiny sizes: bring_your_own (plain and sharded), plan_on_paper."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from lightning_shardrec.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "4", "--val-batches", "2", "--global-batch", "32"]
QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


def _bring_your_own():
    spec = importlib.util.spec_from_file_location("bring_your_own_train", ROOT / "examples/bring_your_own/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sharded(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    return _bring_your_own().main(["--strategy", "shardrec", "--devices", str(world), *TINY], **QUIET)


def test_bring_your_own_trains_plain_and_by_changing_only_the_strategy():
    plain = _bring_your_own().main(TINY, **QUIET)
    sharded = run_ranks(_sharded, 2)[0]
    for metrics in (plain, sharded):
        assert 0.0 <= metrics["val_auroc"] <= 1.0 and metrics["val_loss"] > 0


def test_plan_on_paper_for_128_gpus(capsys):
    from lightning_shardrec.plan import main

    tables = ROOT / "examples/plan_on_paper/tables.yaml"
    code = main(["--tables", str(tables), "--world-size", "128", "--local-world-size", "8", "--batch-size", "8192"])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("user_id", "item_id", "user_history", "query_tokens", "country", "ad_id"):
        assert f"| {name} " in out
    assert " 127 |" in out  # one row per rank of the pretend cluster


def _existing_model(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    spec = importlib.util.spec_from_file_location("existing_model_train", ROOT / "examples/existing_model/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--strategy", "shardrec", "--devices", str(world), "--steps", "3", "--global-batch", "32"],
                       **QUIET)


def test_existing_model_trains_sharded_unchanged():
    figures = run_ranks(_existing_model, 2)
    tables_mib = 400_000 * 32 * 4 / 2**20
    assert sum(f["embedding_mib"] for f in figures) == pytest.approx(tables_mib)  # each table held once
    assert all(f["train_loss"] > 0 for f in figures)
