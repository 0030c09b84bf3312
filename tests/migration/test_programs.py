"""Real TorchRec programs (its examples and tutorials, shrunk to CPU) run after ``s/torchrec/lightning_shardrec/``.

The program texts in ``programs/`` keep TorchRec's imports; each test replaces the text ``torchrec``
with ``lightning_shardrec`` and nothing else, then runs it on gloo ranks.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from lightning_shardrec.testing import run_ranks

PROGRAMS = Path(__file__).parent / "programs"


def load(name: str) -> types.ModuleType:
    """The program ``programs/<name>.py`` with ``torchrec`` replaced by ``lightning_shardrec``, as a module."""
    text = (PROGRAMS / f"{name}.py").read_text()
    assert "torchrec" in text
    module = types.ModuleType(f"migrated_{name}")
    exec(compile(text.replace("torchrec", "lightning_shardrec"), f"<migrated {name}>", "exec"), module.__dict__)
    return module


def _golden(rank, world, pipelined):
    program = load("golden_training_dlrm")
    if not pipelined:  # the same program with a plain loop in place of TrainPipelineSparseDist
        from lightning_shardrec.distributed.train_pipeline import train_pipelines

        class Plain:
            def __init__(self, model, optimizer, device):
                self.model, self.optimizer = model, optimizer

            def progress(self, it):
                batch = next(it)
                self.optimizer.zero_grad()
                loss, output = self.model(batch)
                loss.backward()
                self.optimizer.step()
                return output

        program.TrainPipelineSparseDist = Plain
        assert train_pipelines.TrainPipelineSparseDist is not Plain
    return program.train(num_iterations=4)


@pytest.mark.parametrize("world", [1, 2])
def test_golden_training_dlrm_runs_and_the_pipeline_matches_a_plain_loop(world):
    piped = run_ranks(_golden, world, True)
    plain = run_ranks(_golden, world, False)
    for p, q in zip(piped, plain, strict=True):
        assert len(p) == 4 and all(torch.isfinite(torch.tensor(p)))
        assert torch.allclose(torch.tensor(p), torch.tensor(q), atol=1e-6), (p, q)
