"""Transport stress: short 2-rank fits with DataLoader workers beside a CPU hog, on both transports.

    python benchmarks/transport_stress.py [--runs 100] [--transports pg,auto] [--hogs 1] [--timeout 120]

Each run is a fresh job: ``python transport_stress.py --child <transport>`` starts a
``Trainer(strategy=ShardRecStrategy(comm_transport=...), devices=2)`` through Lightning's own
launcher (rank 0 launches rank 1), whose loader is ``DataLoader(num_workers=2,
pin_memory=True)`` (forked workers beside gloo's threads, the shared-memory transport's FIFOs
and the heartbeat thread), and fits 8 steps with ``pipeline=True`` on every other run.
Transports alternate run by run; ``--hogs`` processes spin on the CPU meanwhile. A run that does
not finish within ``--timeout`` seconds counts as a hang (its process group is killed); one
that exits non-zero or does not print its result counts as a failure. One line per run, then
a summary; the exit status is the number of hangs and failures (capped at 100).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_model  # noqa: E402

TABLES = [f"f{i}" for i in range(4)]


def _hog() -> None:
    while True:
        pass


def child(transport: str, pipeline: bool) -> None:
    """One job: 8 steps of a small DLRM-like model, loader workers pinning memory."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, ShardRecStrategy
    from lightning_shardrec.data import SyntheticRecDataModule

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(num_embeddings=2000, embedding_dim=16, name=f"t_{f}", feature_names=[f])
                    for f in TABLES
                ]
            )
            self.mlp = torch.nn.Linear(3 + 16 * len(TABLES), 1)

        def training_step(self, batch, i):
            x = torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)
            return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), batch.labels)

        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.05)

    class Data(L.LightningDataModule):
        def setup(self, stage: str) -> None:
            dm = SyntheticRecDataModule(
                num_dense=3, tables=[{"name": f, "num_embeddings": 2000} for f in TABLES], batch_size=128,
                num_batches=16, seed=self.trainer.global_rank,
            )  # fmt: skip
            dm.setup("fit")
            self.batches = [dm.datasets["train"].batch(i) for i in range(8)]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(
                self.batches, batch_size=None, num_workers=2, pin_memory=True, persistent_workers=False
            )

    strategy = ShardRecStrategy(comm_transport=transport, pipeline=pipeline)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(Model(), Data())
    used = next(iter(strategy.sharded.values())).env.transport is not None
    print(f"STRESS_DONE rank={trainer.global_rank} steps={trainer.global_step} shm={used}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--transports", default="pg,auto")
    p.add_argument("--hogs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pipeline", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.pipeline)
        return 0
    transports = a.transports.split(",")
    hogs = [mp.Process(target=_hog, daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    counts = {t: {"ok": 0, "hung": 0, "failed": 0, "seconds": []} for t in transports}
    try:
        for i in range(a.runs):
            transport, pipeline = transports[i % len(transports)], (i // len(transports)) % 2 == 1
            cmd = [sys.executable, __file__, "--child", transport] + (["--pipeline"] if pipeline else [])
            start = time.monotonic()
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            try:
                out, _ = proc.communicate(timeout=a.timeout)
                verdict = "ok" if proc.returncode == 0 and out.count("STRESS_DONE") == 2 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                verdict = "hung"
            took = time.monotonic() - start
            counts[transport][verdict] += 1
            counts[transport]["seconds"].append(took)
            print(
                f"run {i}: {transport} pipeline={pipeline}: {verdict} ({took:.1f} s, rc {proc.returncode})", flush=True
            )
            if verdict != "ok":
                print("\n".join(out.splitlines()[-15:]), flush=True)
    finally:
        for h in hogs:
            h.kill()
    cpu = cpu_model()
    print(f"transport_stress: {a.runs} runs, {a.hogs} CPU hog(s), {os.cpu_count()} CPUs ({cpu})")
    bad = 0
    for t, c in counts.items():
        secs = sorted(c["seconds"]) or [0.0]
        print(
            f"  {t}: {c['ok']} ok, {c['hung']} hung, {c['failed']} failed; seconds per run median "
            f"{secs[len(secs) // 2]:.1f}, max {secs[-1]:.1f}"
        )
        bad += c["hung"] + c["failed"]
    return min(bad, 100)


if __name__ == "__main__":
    sys.exit(main())
