"""Exit stress: a short 2-rank ``fit`` + ``trainer.save_checkpoint`` run again and again, under load.

    python benchmarks/exit_stress.py [--runs 100] [--hogs 1] [--steps 3] [--no-pipeline]

Each run starts 2 fresh processes (rank 0 and rank 1, gloo on CPU, launched as a job
scheduler would: ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` set, so Lightning starts
nothing itself) that train a tiny DLRM for ``--steps`` steps with
``ShardRecStrategy(pipeline=True)`` (every group the strategy makes: dense DDP,
pipeline prefetch, lagged SIGTERM; the health monitor's thread), save a sharded
checkpoint with ``trainer.save_checkpoint`` and return from the script. Meanwhile
``--hogs`` processes spin on the CPU. A run is abnormal when either rank exits non-zero
(-6 is SIGABRT: ``terminate called without an active exception``), does not report
its steps and saved checkpoint, or does not finish in ``--timeout`` seconds. Prints one
line per run and a summary (runs, abnormal exits, CPU); the exit status is the number
of abnormal runs (capped at 100).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hog() -> None:
    while True:
        pass


def cpu_model() -> str:
    """``lscpu``'s model name (``platform.processor()`` when lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def worker(root: str, steps: int, pipeline: bool) -> None:
    """One rank: fit ``steps`` steps, save a checkpoint, return (the process then exits)."""
    import lightning as L
    import torch

    from lightning_shardrec import ShardRecStrategy, SyntheticRecDataModule
    from lightning_shardrec.models import DLRMTask

    torch.set_num_threads(1)
    tables = [{"name": "a", "num_embeddings": 64}, {"name": "b", "num_embeddings": 9}]
    data = SyntheticRecDataModule(num_dense=4, tables=tables, batch_size=8, num_batches=steps, val_batches=0)
    model = DLRMTask(embedding_dim=4, num_dense=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1])
    trainer = L.Trainer(
        strategy=ShardRecStrategy(pipeline=pipeline),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=data)
    path = os.path.join(root, "last.ckpt")
    trainer.save_checkpoint(path)
    print(f"rank {trainer.global_rank} done: {trainer.global_step} steps, saved={os.path.isdir(path)}", flush=True)


def one_run(steps: int, pipeline: bool, timeout: float) -> tuple[list[int | None], bool, str]:
    """Both ranks' exit codes (None: killed after ``timeout``), whether both trained ``steps`` steps
    and saved, and the tail of their stderr."""
    port = str(_free_port())
    with tempfile.TemporaryDirectory(prefix="shardrec_exit_") as root:
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "NODE_RANK": "0",
                "LOCAL_WORLD_SIZE": "2",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            }
            cmd = [sys.executable, __file__, "--worker", root, "--steps", str(steps)]
            if not pipeline:
                cmd.append("--no-pipeline")
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        codes: list[int | None] = []
        tails = []
        finished = True
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                codes.append(None)
            finished &= f"done: {steps} steps, saved=True" in (out or "")
            tails.append(err[-400:] if err else "")
    return codes, finished, " | ".join(t.strip().replace("\n", " / ")[-300:] for t in tails if t.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--hogs", type=int, default=1, help="CPU-spinning processes during the runs")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--no-pipeline", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.steps, not a.no_pipeline)
        return 0
    hogs = [mp.get_context("spawn").Process(target=_hog, daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    abnormal = 0
    start = time.monotonic()
    try:
        for i in range(a.runs):
            t0 = time.monotonic()
            codes, finished, tail = one_run(a.steps, not a.no_pipeline, a.timeout)
            bad = any(c != 0 for c in codes) or not finished
            abnormal += bad
            note = f"  stderr: {tail}" if bad else ""
            print(f"run {i + 1}/{a.runs}: exit codes {codes} ({time.monotonic() - t0:.0f} s){note}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(
        f"exit_stress: {a.runs} runs, {abnormal} abnormal exits, {a.hogs} CPU hog(s), "
        f"{time.monotonic() - start:.0f} s, CPU {cpu_model()} x {os.cpu_count()}",
        flush=True,
    )
    return min(abnormal, 100)


if __name__ == "__main__":
    raise SystemExit(main())
