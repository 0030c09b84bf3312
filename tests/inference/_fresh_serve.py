"""Serve an exported artifact in a fresh interpreter that cannot import lightning_shardrec (or the tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

_SCRIPT = r"""
import sys

class _Block:  # importing the library (or the tests' model code) must fail here
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning_shardrec", "_quant_models", "test_plain_modules", "lightning"):
            raise ImportError(f"{name} is blocked in the serving process")
        return None

sys.meta_path.insert(0, _Block())
import torch

artifact, fmt, inputs, outputs = sys.argv[1:5]
if fmt == "pt2":
    program = torch.export.load(artifact).module()
else:
    import torch._inductor

    program = torch._inductor.aoti_load_package(artifact)
with torch.no_grad():
    out = [program(*args) for args in torch.load(inputs, weights_only=True)]
torch.save(out, outputs)
print("served", len(out), "batches;", sorted(m for m in sys.modules if m.startswith("lightning_shardrec")))
"""


def serve_fresh(artifact: Path, fmt: str, inputs: list[tuple], tmp: Path) -> list:
    """The program's outputs on ``inputs`` (plain tensors/dicts), computed in a fresh process."""
    torch.save(inputs, tmp / "inputs.pt")
    script = tmp / "serve.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), str(artifact), fmt, str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "served" in done.stdout and "[]" in done.stdout, done.stdout
    return torch.load(tmp / "outputs.pt", weights_only=True)
