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


@pytest.mark.needs_fbgemm  # the recorded TorchRec run: fbgemm's kernels and enums
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


#: TorchRec 1.8's int8 lookups for ``programs/intro_inference.py``'s KJT, rounded to 8 places: the program run
#: unrenamed in /work/venvs/torchrec (its CPU build cannot run the ``_shard_modules`` cell, which needs CUDA,
#: so that one cell was replaced by ``sharded_qebc = qebc``), then
#: ``[round(x, 8) for x in result["quantized"][key].flatten().tolist()]``
TORCHREC_INT8 = {
    "product": [
        -0.00187111, -0.09154415, -0.09723473, -0.01336384, 0.08289242, 0.10279083, 0.02725124, -0.07257557,
        -0.10664463, -0.042449, 0.06172943, 0.10766315, 0.05555534, -0.04691219, -0.10779762, -0.06770325,
    ] + [0.0] * 16,
    "user": [
        0.02155447, -0.09816647, 0.05911398, 0.04815912, -0.09973145, 0.0348568, 0.07085133, -0.09347153,
        0.00668716, 0.0880661, -0.0801692, -0.02069998, 0.09745598, -0.05982447, -0.04730463, 0.09980345,
        -0.08556557, -0.01151419, 0.09536409, -0.06800699, -0.03823376, 0.09994459, -0.04434109, -0.06266308,
        0.09689093, -0.01762152, -0.08174849, 0.0862031, 0.01062489, -0.09472656, 0.06864452, 0.03810787,
    ],
}  # fmt: skip


def test_intro_inference_part_quantizes_to_torchrecs_int8_lookups():
    got = _detached(load("intro_inference").main())
    assert got["params_left"] == []  # quantized tables are buffers, as in TorchRec
    assert got["buffers"]["ebc_.embedding_bags.product_table.weight"] == ((4096, 16), "torch.uint8")
    for key, want in TORCHREC_INT8.items():
        want = torch.tensor(want).reshape(2, 16)
        for path in ("quantized", "served", "helper"):  # quantize_dynamic, then _shard_modules; quantize_embeddings
            torch.testing.assert_close(got[path][key], want, rtol=0, atol=1e-7, msg=f"{path} {key}")
        assert not torch.allclose(got["float"][key], want, rtol=0, atol=1e-7)  # int8, not the float rows
