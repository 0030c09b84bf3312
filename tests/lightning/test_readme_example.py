"""The README's example, as a user writes it: (dense, kjt, y) tuples from a plain DataLoader.

The README's first snippet runs as written (2 processes started by Lightning's launcher).
`devices=2` with `strategy="shardrec"` (each rank loading its half of every global batch)
ends with the same weights as `devices=1` without the strategy on the global batches,
with and without the pipeline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import external_launch

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.testing import run_ranks

GLOBAL, STEPS = 8, 5
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two fresh Lightning processes: about a minute on a loaded 2-core machine
def test_readme_first_snippet_runs_as_written(tmp_path):
    snippet = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert snippet is not None and "devices=2" in snippet.group(1)
    script = tmp_path / "readme_example.py"
    script.write_text(snippet.group(1))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=20` reached." in done.stdout + done.stderr


class Rec(L.LightningModule):  # the README's module
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="user_table", embedding_dim=16, num_embeddings=50_000, feature_names=["user_hist"])])
        self.mlp = torch.nn.Linear(4 + 16, 1)

    def training_step(self, batch, i):
        dense, kjt, y = batch
        x = torch.cat([dense, self.ebc(kjt).values()], 1)
        return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)


def batches(lo: int, hi: int) -> list:
    """Rows [lo, hi) of each global batch (generated whole, so every rank sees the same data)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (GLOBAL,), generator=g)
        ids = torch.randint(0, 50_000, (int(lengths.sum()),), generator=g)
        dense, y = torch.randn(GLOBAL, 4, generator=g), torch.rand(GLOBAL, generator=g).round()
        start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
        kjt = KeyedJaggedTensor(["user_hist"], ids[start:end], lengths=lengths[lo:hi])
        out.append((dense[lo:hi], kjt, y[lo:hi]))
    return out


def trainer(**kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def fit_sharded(rank, world, pipeline):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    half = GLOBAL // world
    loader = torch.utils.data.DataLoader(batches(rank * half, (rank + 1) * half), batch_size=None)
    strategy = ShardRecStrategy(pipeline=pipeline)
    trainer(strategy=strategy, devices=world, use_distributed_sampler=False).fit(Rec(), loader)
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


@pytest.mark.parametrize("pipeline", [False, True])
def test_readme_example_matches_one_device(pipeline):
    got = run_ranks(fit_sharded, 2, pipeline)[0]
    want = Rec()
    trainer(devices=1).fit(want, torch.utils.data.DataLoader(batches(0, GLOBAL), batch_size=None))
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
