"""The "Introduction to TorchRec" tutorial's sharding and inference parts, run after ``s/torchrec/lightning_shardrec/``
(issue 43). The program texts in ``programs/`` keep TorchRec's imports.

TorchRec facts the checks use (TorchRec 1.8, ``/work/venvs/torchrec``, the same program unrenamed):
``sharder.shard(ebc, plan.plan[""], env, device)`` returns a module whose ``forward(kjt).wait()`` is a
KeyedTensor with keys ``['product', 'user']``; the sharder's ``fused_params`` (rowwise adagrad, lr 0.02,
eps 0.002) and torch's ``_apply_optimizer_in_backward(SGD, lr=0.5)`` show in ``fused_optimizer``'s
param group; one backward through ``sum(1 - out)`` lowers the loss by
``16 * (2 * 0.04 / 2.002 + 2 * 0.02 / 1.002)`` = 1.27808 (TorchRec printed 63.87235 -> 62.59427).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from lightning_shardrec.testing import run_ranks

PROGRAMS = Path(__file__).parent / "programs"


def load(name: str) -> types.ModuleType:
    text = (PROGRAMS / f"{name}.py").read_text()
    assert "torchrec" in text
    module = types.ModuleType(f"migrated_{name}")
    exec(compile(text.replace("torchrec", "lightning_shardrec"), f"<migrated {name}>", "exec"), module.__dict__)
    return module


def _detached(x):
    return {k: _detached(v) for k, v in x.items()} if isinstance(x, dict) else x.detach() if torch.is_tensor(x) else x


def _sharding(rank, world):
    return _detached(load("intro_sharding").main())


def test_intro_sharding_part_runs_and_trains_as_torchrecs():
    (got,) = run_ranks(_sharding, 1)
    assert got["keys"] == ["product", "user"]
    for key in ("product", "user"):  # the sharded collection starts from the module's rows here
        torch.testing.assert_close(got["sharded"][key], got["eager"][key])
    first, second = got["losses"]
    assert first == pytest.approx(64 - sum(float(v.sum()) for v in got["eager"].values()), rel=1e-6)
    assert first - second == pytest.approx(16 * (2 * 0.04 / 2.002 + 2 * 0.02 / 1.002), rel=1e-4)
    assert got["fused"] == pytest.approx((0.02, 0.002)) and got["sgd_lr"] == 0.5
    assert torch.equal(got["awaited"], torch.ones(3, 2))
