"""One user program at any world size: ``Trainer(strategy="shardrec")``, gloo, tiny tables, small batches.

    python tests/lightning/_scale_run.py OUT --world W [--kind row_wise] [--kill R --step S]
                                          [--save PATH] [--resume PATH]

:func:`launch` starts ``W`` processes of this script on this machine, each told its rank as
torchrun would (``RANK``, ``WORLD_SIZE``, ...; no elastic agent), so each rank detects a lost peer
on its own. Each rank writes ``OUT/rank<r>.json`` (its timings from launch, step times, resident
peak, the health monitor's store operations) and its output to ``OUT/rank<r>.log``; rank 0 writes
the full state dict to ``OUT/final.pt``. ``--kill R --step S``: rank R SIGKILLs itself before step
S (``OUT/fault_at``: when). Used by ``tests/lightning/test_scale.py`` and
``benchmarks/scale_harness.py``.
"""

from __future__ import annotations

import time

STARTED = time.time()  # noqa: E402  before the imports: launch to first step includes them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

STEPS, GLOBAL_BATCH = 6, 48  # 48: whole per-rank batches at 1, 2, 8, 12, 16 and 24 ranks


@dataclass(frozen=True)
class Launched:
    """What :func:`launch` saw: each rank's exit code and when it ended (``time.time()``), and the output folder."""

    codes: list[int]
    ended: list[float]
    out: Path

    def log(self, rank: int) -> str:
        return (self.out / f"rank{rank}.log").read_text(errors="replace")

    def figures(self, rank: int) -> dict[str, object]:
        return json.loads((self.out / f"rank{rank}.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, out: Path, *args: str, timeout: float = 900.0) -> Launched:
    """Start ``world`` ranks of this script (``args`` passed on) and wait for every one to end."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONUNBUFFERED": "1"}
    env.update(WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world), SCALE_LAUNCHED=repr(time.time()))
    env.pop("TORCHELASTIC_RUN_ID", None)
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115  closed below
        cmd = [sys.executable, str(Path(__file__)), str(out), "--world", str(world), *args]
        ranked = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append((subprocess.Popen(cmd, env=ranked, stdout=log, stderr=subprocess.STDOUT), log))
    codes, ended = [0] * world, [0.0] * world
    deadline = time.time() + timeout
    waiting = set(range(world))
    while waiting:
        for rank in list(waiting):
            code = procs[rank][0].poll()
            if code is not None:
                codes[rank], ended[rank] = code, time.time()
                waiting.discard(rank)
        if time.time() > deadline:
            for rank in waiting:
                procs[rank][0].kill()
            raise TimeoutError(f"{world} ranks: ranks {sorted(waiting)} still running after {timeout:.0f} s")
        time.sleep(0.05)
    for _, log in procs:
        log.close()
    return Launched(codes, ended, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--kind", choices=["row_wise", "table_wise"])
    parser.add_argument("--kill", type=int)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    import lightning as L
    import torch
    from _memory import peak, rss
    from _models import TABLES, Rec, data, trainer

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    imported = time.time()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    times: dict[str, object] = {"launched": float(os.environ.get("SCALE_LAUNCHED", STARTED))}
    times.update(started=STARTED, imported=imported, step=[])

    class Clock(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, *_: object) -> None:
            times["fit_start"] = time.time()  # process group up, model sharded

        def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
            self.began = time.perf_counter()
            if args.kill == trainer.global_rank and trainer.global_step == args.step:
                (args.out / "fault_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
            times.setdefault("first_step", time.time())
            times["step"].append(time.perf_counter() - self.began)  # type: ignore[union-attr]
            if len(times["step"]) == 2 and strategy.monitor is not None:  # type: ignore[arg-type]
                times["steady_ops"] = strategy.monitor.store_ops  # set-up is over: from here, steady operations
                times["steady_at"] = time.time()

        def on_train_end(self, trainer: L.Trainer, *_: object) -> None:
            monitor = strategy.monitor
            times["store_ops"] = monitor.store_ops if monitor is not None else 0
            times["monitor_interval"] = monitor.interval if monitor is not None else None
            times["train_end"] = time.time()

    kinds = {f"t_{f}": ParameterConstraints(sharding_types=[args.kind]) for f, *_ in TABLES} if args.kind else {}
    strategy = ShardRecStrategy(constraints=kinds, heartbeat_timeout=20.0)
    t = trainer(strategy=strategy, devices=args.world, max_steps=args.steps, callbacks=[Clock()])
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // args.world, args.steps), ckpt_path=args.resume)
    if args.save:
        t.save_checkpoint(args.save)
    state = strategy.full_state_dict(dst=0)
    times.update(rss=rss(), peak=peak())
    if rank == 0:
        torch.save(state, args.out / "final.pt")
    (args.out / f"rank{rank}.json").write_text(json.dumps(times))


if __name__ == "__main__":
    main()
