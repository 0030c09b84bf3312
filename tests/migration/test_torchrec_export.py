"""``torch.export.export(model, (kjt,), strict=False)`` the TorchRec way: a KeyedJaggedTensor input, dynamic
batch and id counts (``Dim`` hints on the KJT's leaves), float and quantized EBC, EC and DLRM. The program
equals eager on inputs of other sizes, saves with ``torch.export.save`` and runs after ``torch.export.load``
in a fresh process (which only imports ``lightning_shardrec``, for the KJT's pytree registration)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

KEYS = ["f0", "f1"]


class Pooled(torch.nn.Module):
    def __init__(self, coll: torch.nn.Module) -> None:
        super().__init__()
        self.coll = coll

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.coll(kjt).values()


class Sequence(torch.nn.Module):
    def __init__(self, coll: torch.nn.Module) -> None:
        super().__init__()
        self.coll = coll

    def forward(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        out = self.coll(kjt)
        return [out[k].values() for k in KEYS]


class Ranking(torch.nn.Module):
    def __init__(self, dlrm: torch.nn.Module) -> None:
        super().__init__()
        self.dlrm = dlrm

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dlrm(dense, kjt)


def _bags() -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[k])
        for i, k in enumerate(KEYS)
    ]
    return EmbeddingBagCollection(tables=configs)


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "ebc":
        return Pooled(_bags())
    if kind == "ec":
        configs = [
            EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[k])
            for i, k in enumerate(KEYS)
        ]
        return Sequence(EmbeddingCollection(tables=configs))
    if kind == "quant-ec":
        from lightning_shardrec.inference import QuantEmbeddingCollection

        seq = model("ec").coll
        return Sequence(QuantEmbeddingCollection.from_float(seq, "int8"))  # type: ignore[arg-type]
    if kind.startswith("quant"):
        from lightning_shardrec.inference import quantize

        return quantize(Pooled(_bags()), "int8", backend=kind.split("-")[1])
    from lightning_shardrec.models.dlrm import DLRM

    return Ranking(DLRM(_bags(), dense_in_features=3, dense_arch_layer_sizes=[8, 8], over_arch_layer_sizes=[8, 1]))


def inputs(kind: str, batch: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.randint(0, 20, (int(lengths.sum()),), generator=g), lengths=lengths
    )
    return (torch.rand(batch, 3, generator=g), kjt) if kind == "dlrm" else (kjt,)


def shapes(kind: str) -> tuple:
    kjt = [{0: Dim("ids", min=0)}, None, {0: len(KEYS) * Dim("batch", min=1)}, None, None, None]
    return ({0: Dim("batch", min=1)}, kjt) if kind == "dlrm" else (kjt,)


def flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, list | tuple) else [out]


@pytest.mark.parametrize("kind", ["ebc", "ec", "quant-torch", "quant-auto", "quant-ec", "dlrm"])
def test_export_with_a_kjt_input_equals_eager_and_loads_in_a_fresh_process(kind, tmp_path: Path):
    if kind == "quant-auto":
        pytest.importorskip("fbgemm_gpu")
    m = model(kind).eval()
    with torch.no_grad():
        m(*inputs(kind, 2, 2))  # a quantized collection builds its lookup on the first call (eager, as served)
    ep = torch.export.export(m, inputs(kind, 3, 0), dynamic_shapes=shapes(kind), strict=False)
    other = inputs(kind, 5, 1)  # another batch size and id count
    with torch.no_grad():
        want = flat(m(*other))
    for got, w in zip(flat(ep.module()(*other)), want, strict=True):
        assert torch.equal(got, w)
    torch.export.save(ep, tmp_path / "program.pt2")
    torch.save({"inputs": other, "want": want}, tmp_path / "io.pt")
    # fbgemm's quantized lookup is an fbgemm op: its program loads where fbgemm_gpu is imported (as under TorchRec,
    # whose import loads it); every other program here is torch ops only
    fbgemm = "import fbgemm_gpu\n" if kind == "quant-auto" else ""
    code = (
        fbgemm + "import sys, torch, lightning_shardrec\n"
        "ep = torch.export.load(sys.argv[1]); io = torch.load(sys.argv[2], weights_only=False)\n"
        "out = ep.module()(*io['inputs']); out = list(out) if isinstance(out, (list, tuple)) else [out]\n"
        "assert all(torch.equal(a, b) for a, b in zip(out, io['want'], strict=True)), 'differs'\n"
        "print('ran', len(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "program.pt2"), str(tmp_path / "io.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-2000:]
