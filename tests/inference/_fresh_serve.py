"""Serve exported artifacts in one fresh interpreter that cannot import lightning_shardrec (or the tests)."""

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

outputs = []
for artifact, fmt, inputs in torch.load(sys.argv[1], weights_only=True):
    if fmt == "pt2":
        program = torch.export.load(artifact).module()
    else:
        import torch._inductor

        program = torch._inductor.aoti_load_package(artifact)
    with torch.no_grad():
        outputs.append([program(*args) for args in inputs])
torch.save(outputs, sys.argv[2])
print("served", len(outputs), "artifacts;", sorted(m for m in sys.modules if m.startswith("lightning_shardrec")))
"""


def serve_fresh(jobs: list[tuple[Path, str, list[tuple]]], tmp: Path) -> list[list]:
    """Per ``(artifact, "pt2" | "aoti", inputs)`` job, the program's outputs on its inputs (plain
    tensors/dicts), all computed in one fresh process (starting one costs seconds)."""
    torch.save([(str(a), fmt, inputs) for a, fmt, inputs in jobs], tmp / "jobs.pt")
    script = tmp / "serve.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp / "jobs.pt"), str(tmp / "outputs.pt")],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "served" in done.stdout and "[]" in done.stdout, done.stdout
    return torch.load(tmp / "outputs.pt", weights_only=True)
