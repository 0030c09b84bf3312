"""The same numbers as TorchRec 1.8, side by side (issue 43): storage reservations and a quantized EmbeddingCollection.

One child process per library computes, on fixed inputs: the bytes per rank each TorchRec storage reservation
leaves (``HeuristicalStorageReservation`` with and without pooling factors, ``FixedPercentage``, a CPU
topology) and the outputs of an ``EmbeddingCollection`` with fixed rows after ``quantize_inference_model`` to
int8, int4 (``torch.quint4x2``) and fp16. TorchRec's child runs in ``benchmarks/.venv-torchrec``
(``benchmarks/setup_torchrec_venv.sh``); the parent prints each figure and the largest difference.

Usage (from the repository root)::

    PYTHONPATH=$PWD python benchmarks/torchrec_parity.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TORCHREC_PYTHON = HERE / ".venv-torchrec" / "bin" / "python"
MiB = 1 << 20


def _measure(lib: str, out: str) -> None:
    """Run in the child: ``lib`` is ``torchrec`` or ``lightning_shardrec``."""
    import copy
    import importlib

    trec = importlib.import_module(lib)
    reservations = importlib.import_module(f"{lib}.distributed.planner.storage_reservations")
    types = importlib.import_module(f"{lib}.distributed.planner.types")
    quantize_inference_model = importlib.import_module(f"{lib}.inference.modules").quantize_inference_model

    config = trec.EmbeddingBagConfig(num_embeddings=1000, embedding_dim=8, name="t", feature_names=["f", "g"])
    model = torch.nn.Sequential(
        trec.EmbeddingBagCollection(tables=[config], device=torch.device("meta")), torch.nn.Linear(8, 1000)
    )
    sharders = [importlib.import_module(f"{lib}.distributed.embeddingbag").EmbeddingBagCollectionSharder()]
    cuda = types.Topology(world_size=2, compute_device="cuda", hbm_cap=MiB)
    cpu = types.Topology(world_size=2, compute_device="cpu", ddr_cap=MiB)
    pooling = {"t": types.ParameterConstraints(pooling_factors=[3.0, 2.0])}
    cases = {
        "heuristical 10%, cuda": (reservations.HeuristicalStorageReservation(0.1), cuda, None),
        "heuristical 10%, cuda, pooling 3+2": (reservations.HeuristicalStorageReservation(0.1), cuda, pooling),
        "fixed 25%, cuda": (reservations.FixedPercentageStorageReservation(0.25), cuda, None),
        "heuristical 10%, cpu": (reservations.HeuristicalStorageReservation(0.1), cpu, None),
    }
    left = {}
    for name, (reservation, topology, constraints) in cases.items():
        reserved = reservation.reserve(topology, 64, model, sharders, constraints)
        cap = getattr(reserved, "memory_cap", None)  # ours; TorchRec's devices hold their storage
        left[name] = cap if cap is not None else reserved.devices[0].storage.hbm or reserved.devices[0].storage.ddr

    class Sequence(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            table = trec.EmbeddingConfig(num_embeddings=20, embedding_dim=8, name="s", feature_names=["b", "c"])
            self.ec = trec.EmbeddingCollection(tables=[table])

        def forward(self, kjt):  # type: ignore[no-untyped-def]
            out = self.ec(kjt)
            return [t.float() for k in ("b", "c") for t in (out[k].values(), out[k].lengths())]

    float_model = Sequence()
    with torch.no_grad():
        float_model.ec.embeddings["s"].weight.copy_(torch.sin(torch.arange(160.0)).view(20, 8) * 0.3)
    kjt = trec.KeyedJaggedTensor.from_lengths_sync(
        ["b", "c"], torch.tensor([1, 2, 3, 4, 5, 19, 0]), torch.tensor([1, 2, 0, 2, 1, 1])
    )
    outputs = {}
    for dtype in (torch.int8, torch.quint4x2, torch.float16):
        quantized = quantize_inference_model(copy.deepcopy(float_model), quantization_dtype=dtype)
        outputs[str(dtype)] = quantized(kjt)
    torch.save({"left": left, "outputs": outputs}, out)


def main() -> None:
    if not TORCHREC_PYTHON.exists():
        sys.exit("no benchmarks/.venv-torchrec: run benchmarks/setup_torchrec_venv.sh")
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for lib, python in (("torchrec", str(TORCHREC_PYTHON)), ("lightning_shardrec", sys.executable)):
            out = f"{tmp}/{lib}.pt"
            code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import torchrec_parity as p; "
            code += f"p._measure({lib!r}, {out!r})"
            subprocess.run([python, "-c", code], check=True, cwd=HERE.parent, capture_output=True)
            results[lib] = torch.load(out)
    theirs, ours = results["torchrec"], results["lightning_shardrec"]
    print("bytes per rank left of 1 MiB          TorchRec   here")
    for name, n in theirs["left"].items():
        print(f"  {name:36s} {n:9d} {ours['left'][name]:9d}  {'equal' if n == ours['left'][name] else 'DIFFER'}")
    print("quantized EmbeddingCollection         largest |difference|")
    for dtype, want in theirs["outputs"].items():
        diff = max((a - b).abs().max().item() for a, b in zip(want, ours["outputs"][dtype], strict=True))
        print(f"  {dtype:36s} {diff:g}")


if __name__ == "__main__":
    main()
