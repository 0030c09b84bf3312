"""A 2-rank ``Trainer(strategy="shardrec")`` fit launched by Lightning's own subprocess launcher,
with an optional fault: ``--fault kill|stop --rank R --step S`` sends SIGKILL (dead) or SIGSTOP
(hung) to rank R before step S.

    python tests/lightning/_fault_run.py OUT [--fault kill --rank 1 --step 7] [--resume]

Checkpoints every 5 steps (and ``last``) under ``OUT/ckpt``; at the end rank 0 writes the
full state dict to ``OUT/final.pt`` and the number of batches it trained to ``OUT/ran``;
``OUT/times.json`` holds rank 0's timings (seconds of each checkpoint save, of the
restore, of each step).
Used by ``tests/lightning/test_rank_failure.py`` and ``benchmarks/reliability_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _models import Rec, data, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shardrec import ShardRecStrategy

STEPS, GLOBAL_BATCH = 10, 12


class Fault(L.Callback):
    """Counts the batches this run trains; sends ``sig`` to rank ``rank`` before step ``step``."""

    def __init__(self, sig: signal.Signals | None, rank: int, step: int, out: Path) -> None:
        self.sig, self.rank, self.step, self.out = sig, rank, step, out
        self.ran = 0
        self.times: dict[str, list[float]] = {"save": [], "load": [], "step": []}
        self._step_started = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self.ran += 1
        self._step_started = time.perf_counter()
        if self.sig is not None and trainer.global_rank == self.rank and trainer.global_step == self.step:
            (self.out / "fault_at").write_text(repr(time.time()))
            os.kill(os.getpid(), self.sig)

    def on_train_batch_end(self, *args: object) -> None:
        self.times["step"].append(time.perf_counter() - self._step_started)

    def timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[kind].append(time.perf_counter() - started)

        return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault", choices=["kill", "stop"])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=7)
    parser.add_argument("--heartbeat-timeout", type=float, default=20.0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=5, save_top_k=-1, save_last=True)
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, None: None}[args.fault]
    fault = Fault(sig, args.rank, args.step, args.out)
    strategy = ShardRecStrategy(heartbeat_timeout=args.heartbeat_timeout)
    strategy.save_checkpoint = fault.timed("save", strategy.save_checkpoint)  # type: ignore[method-assign]
    strategy.load_checkpoint = fault.timed("load", strategy.load_checkpoint)  # type: ignore[method-assign]
    callbacks = [checkpoints, fault]
    t = trainer(strategy=strategy, devices=2, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=True)
    torch.set_num_threads(1)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // 2, STEPS), ckpt_path="last" if args.resume else None)
    state = strategy.full_state_dict()
    if t.global_rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, args.out / "final.pt")
        (args.out / "ran").write_text(str(fault.ran))
        (args.out / "times.json").write_text(json.dumps(fault.times))


if __name__ == "__main__":
    main()
