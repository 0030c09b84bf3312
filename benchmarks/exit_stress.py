"""Exit stress: short fits and pytest sessions run again and again beside a CPU hog; every process must exit 0.

    python benchmarks/exit_stress.py [--fits 200] [--sessions 20] [--hogs 1] [--steps 3]
                                     [--kinds lightning,pipeline,dmp,fabric,fabric_launch]
                                     [--tests tests/distributed ...]

A *fit* starts 2 fresh processes, launched as a job scheduler would (``MASTER_ADDR``/``RANK``/
``WORLD_SIZE`` set, gloo on CPU), of one kind in turn (``--kinds``, default the first three):

* ``lightning``: a tiny DLRM, ``ShardRecStrategy()``, ``--steps`` steps, then ``trainer.save_checkpoint``;
  the process returns from the script (the strategy's groups, the health monitor's threads,
  the shared-memory transports and the default group are the library's to shut down);
* ``pipeline``: the same with ``ShardRecStrategy(pipeline=True)`` (the prefetch group too);
* ``dmp``: a TorchRec-style program: ``init_process_group``, ``DistributedModelParallel``,
  ``--steps`` steps, then ``dist.destroy_process_group()`` on each rank *without* a barrier;
* ``fabric``: a Fabric script, ``Fabric(strategy="shardrec")``, ``fabric.setup(model, optimizer)``,
  ``--steps`` steps, ``fabric.save``, and no ``teardown``: the process returns from the script with
  the Fabric object, the model and the optimizer still referenced (a script's globals);
* ``fabric_launch``: the same script started once as a user does (``python script.py``, no rank in
  the environment): Fabric's launcher starts the second rank, whose output comes through the first's.

A *session* is ``python -m pytest -q -p no:cacheprovider`` over ``--tests`` (default: the
distributed tests), the way CI runs them. Meanwhile ``--hogs`` processes spin on the CPU
(each a bounded busy loop: it stops after ``--hog-limit`` seconds or when this script
ends). A process is abnormal when it exits non-zero (-6 is SIGABRT), prints
``terminate called``, does not report its result, or runs past ``--timeout`` seconds.
Faulthandler is on in every process, so an abort prints each Python thread's stack.
Prints one line per run and a summary; the exit status is the number of abnormal runs (capped at 100).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_model, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("lightning", "pipeline", "dmp", "fabric", "fabric_launch")
DEFAULT_KINDS = ("lightning", "pipeline", "dmp")
ABORT = "terminate called"
#: what faulthandler prints when a process dies of a signal (a launched rank's exit code is not seen here)
CRASH = "Fatal Python error"


def _hog(limit: float, parent: int) -> None:
    """Spin for at most ``limit`` seconds, and stop early once ``parent`` is gone."""
    end = time.monotonic() + limit
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(100_000):
            pass


def _tables() -> list[dict[str, object]]:
    return [{"name": "a", "num_embeddings": 64}, {"name": "b", "num_embeddings": 9}]


def lightning_worker(root: str, steps: int, pipeline: bool) -> None:
    """One rank: fit ``steps`` steps, save a checkpoint, return (the process then exits)."""
    import lightning as L
    import torch

    from lightning_shardrec import ShardRecStrategy, SyntheticRecDataModule
    from lightning_shardrec.models import DLRMTask

    torch.set_num_threads(1)
    data = SyntheticRecDataModule(num_dense=4, tables=_tables(), batch_size=8, num_batches=steps, val_batches=0)
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


def dmp_worker(steps: int) -> None:
    """One rank of a TorchRec-style program that ends with ``destroy_process_group()`` and no barrier."""
    import torch
    import torch.distributed as dist

    from lightning_shardrec import (
        DLRM,
        DistributedModelParallel,
        EmbeddingBagCollection,
        FusedOptimConfig,
        SyntheticRecDataModule,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = SyntheticRecDataModule(num_dense=4, tables=_tables(), batch_size=8, num_batches=steps, val_batches=0)
    data.setup("fit")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=data.embedding_tables(4))
    dmp = DistributedModelParallel(
        DLRM(ebc, 4, [8, 4], [8, 1]), embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=0.05)
    )
    opt = torch.optim.Adagrad(list(dmp.dense_parameters()), lr=0.05)
    done = 0
    for batch in data.train_dataloader():
        logits = dmp(batch.dense, batch.sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
    rank = dist.get_rank()
    dist.destroy_process_group()  # each rank on its own, no barrier first
    print(f"rank {rank} done: {done} steps, saved=True", flush=True)


#: what a script written at top level keeps in its globals until the interpreter finalizes (``fabric``)
SCRIPT_NAMES: dict[str, object] = {}


def fabric_worker(root: str, steps: int) -> None:
    """One rank of a Fabric script: ``steps`` steps, ``fabric.save``, return (no ``teardown``, no destroy)."""
    import lightning as L
    import torch

    from lightning_shardrec import DLRM, EmbeddingBagCollection, SyntheticRecDataModule

    torch.set_num_threads(1)
    fabric = L.Fabric(strategy="shardrec", accelerator="cpu", devices=2)
    fabric.launch()  # started alone (``fabric_launch``): starts the second rank
    data = SyntheticRecDataModule(num_dense=4, tables=_tables(), batch_size=8, num_batches=steps, val_batches=0)
    data.setup("fit")
    torch.manual_seed(0)
    model = DLRM(EmbeddingBagCollection(tables=data.embedding_tables(4)), 4, [8, 4], [8, 1])
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    done = 0
    for batch in data.train_dataloader():
        logits = model(batch.dense, batch.sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        done += 1
    path = os.path.join(root, "fabric.ckpt")
    fabric.save(path, {"model": model, "optimizer": opt, "step": done})
    print(f"rank {fabric.global_rank} done: {done} steps, saved={os.path.isdir(path)}", flush=True)
    SCRIPT_NAMES.update(fabric=fabric, model=model, optimizer=opt)  # as a script's own names, alive to the end


def _env(rank: int, port: str) -> dict[str, str]:
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "NODE_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _launch_env(port: str) -> dict[str, str]:
    """``python script.py`` on one machine: no rank in the environment (Fabric's launcher starts the others)."""
    launcher_set = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    env = {k: v for k, v in _env(0, port).items() if k not in launcher_set}
    return env


def one_fit(kind: str, steps: int, timeout: float) -> tuple[list[int | None], bool, int, str]:
    """The ranks' exit codes (None: killed after ``timeout``; ``fabric_launch``: the first rank's only), whether
    every rank reported ``steps`` steps and none crashed (faulthandler's report: a launched rank's exit code is
    not seen), the count of ``terminate called`` lines, and the tail of their stderr."""
    port = str(free_port())
    cmd = [sys.executable, __file__, "--worker", kind, "--steps", str(steps)]
    envs = [_launch_env(port)] if kind == "fabric_launch" else [_env(rank, port) for rank in range(2)]
    with tempfile.TemporaryDirectory(prefix="shardrec_exit_") as root:
        procs = [
            subprocess.Popen([*cmd, "--root", root], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for env in envs
        ]
        codes: list[int | None] = []
        tails, aborts, reported, crashed = [], 0, 0, False
        deadline = time.monotonic() + timeout
        for p in procs:  # a launched rank writes to its launcher's pipes: they close when both have exited
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                codes.append(None)
            reported += (out or "").count(f"done: {steps} steps, saved=True")
            aborts += (err or "").count(ABORT)
            crashed |= CRASH in (err or "")
            tails.append(err[-1500:] if err else "")
    tail = " | ".join(t.strip().replace("\n", " / ")[-1200:] for t in tails if t.strip())
    return codes, reported == 2 and not crashed, aborts, tail


def one_session(tests: list[str], timeout: float) -> tuple[int | None, int, str]:
    """A pytest session over ``tests``: its exit code (None: killed), ``terminate called`` count, its summary."""
    env = {
        **os.environ,
        "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, text.count(ABORT), "timed out"
    text = done.stdout + done.stderr
    summary = next(
        (ln for ln in reversed(done.stdout.splitlines()) if " in " in ln and ("passed" in ln or "failed" in ln)), ""
    )
    tail = "" if done.returncode == 0 else " / ".join(text.strip().splitlines()[-30:])
    return done.returncode, text.count(ABORT), f"{summary} {tail}".strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fits", type=int, default=200, help="2-rank fits (the kinds in turn)")
    p.add_argument("--sessions", type=int, default=20, help="pytest sessions over --tests")
    p.add_argument(
        "--kinds", default=",".join(DEFAULT_KINDS), help=f"fit kinds, comma-separated, of {', '.join(KINDS)}"
    )
    p.add_argument("--tests", nargs="*", default=["tests/distributed"], help="what each pytest session runs")
    p.add_argument("--hogs", type=int, default=1, help="CPU-spinning processes during the runs")
    p.add_argument("--hog-limit", type=float, default=4 * 3600.0, help="seconds after which a hog stops anyway")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per fit")
    p.add_argument("--session-timeout", type=float, default=3600.0, help="seconds per pytest session")
    p.add_argument("--worker", default=None, choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        if a.worker == "dmp":
            dmp_worker(a.steps)
        elif a.worker.startswith("fabric"):
            fabric_worker(str(a.root), a.steps)
        else:
            lightning_worker(str(a.root), a.steps, a.worker == "pipeline")
        return 0
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"--kinds: {unknown or kinds} not among {', '.join(KINDS)}")
    ctx = mp.get_context("spawn")
    hogs = [ctx.Process(target=_hog, args=(a.hog_limit, os.getpid()), daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    abnormal = aborts = 0
    per_kind: dict[str, list[int]] = {k: [0, 0] for k in [*kinds, "session"]}
    start = time.monotonic()
    try:
        for i in range(a.fits):
            kind = kinds[i % len(kinds)]
            t0 = time.monotonic()
            codes, finished, n_abort, tail = one_fit(kind, a.steps, a.timeout)
            bad = any(c != 0 for c in codes) or not finished or n_abort > 0
            abnormal += bad
            aborts += n_abort
            per_kind[kind][0] += 1
            per_kind[kind][1] += bad
            note = f"  stderr: {tail}" if bad else ""
            print(
                f"fit {i + 1}/{a.fits} ({kind}): exit codes {codes} ({time.monotonic() - t0:.0f} s){note}", flush=True
            )
        for i in range(a.sessions):
            t0 = time.monotonic()
            code, n_abort, summary = one_session(a.tests, a.session_timeout)
            bad = code != 0 or n_abort > 0
            abnormal += bad
            aborts += n_abort
            per_kind["session"][0] += 1
            per_kind["session"][1] += bad
            print(
                f"session {i + 1}/{a.sessions}: exit code {code} ({time.monotonic() - t0:.0f} s) {summary}", flush=True
            )
    finally:
        for h in hogs:
            h.terminate()
            h.join(timeout=5)
    kinds_line = ", ".join(f"{k} {bad}/{n}" for k, (n, bad) in per_kind.items() if n)
    print(
        f"exit_stress: {a.fits} fits, {a.sessions} sessions, {abnormal} abnormal, {aborts} '{ABORT}' "
        f"({kinds_line}), {a.hogs} CPU hog(s), {time.monotonic() - start:.0f} s, load {os.getloadavg()[0]:.1f}, "
        f"CPU {cpu_model()} x {os.cpu_count()}",
        flush=True,
    )
    return min(abnormal, 100)


if __name__ == "__main__":
    raise SystemExit(main())
