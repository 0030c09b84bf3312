"""One node's ranks of a multi-node fit, started as a cluster starts them (see ``nodes.py``).

    python tests/multinode/_node.py OUT [--devices 2] [--nodes 2] [--steps 12] [--pace 0.0]
        [--heartbeat-timeout 10] [--resume]

The launcher is whatever the environment says, as Lightning reads it: Lightning's own
(``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE``; this process starts the
node's other ranks), torchrun's or SLURM's (every rank started from outside). The model
is the Lightning tests' ``Rec`` with a host-aware plan: ``t_big`` table-row-wise (its row
blocks inside one host), ``t_mid`` grid-sharded, ``t_tiny`` row-wise; the global batch
is ``GLOBAL_BATCH`` whatever the layout. Rank 0 writes ``OUT/step`` (the global step, each
batch), ``OUT/final.pt`` (the full state dict) and ``OUT/ran`` (batches it trained);
checkpoints every 5 steps (and ``last``) under ``OUT/ckpt``. ``--pace`` sleeps after each
step so that a fault can land mid-run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "lightning"))
from _models import Rec, data, trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_shardrec import ParameterConstraints, ShardRecStrategy  # noqa: E402

GLOBAL_BATCH = 12
TYPES = {"big": "table_row_wise", "mid": "grid_shard", "tiny": "row_wise"}


class Progress(L.Callback):
    """Rank 0 writes the global step to ``out/step`` after each batch; every rank sleeps ``pace`` seconds."""

    def __init__(self, out: Path, pace: float) -> None:
        self.out, self.pace, self.ran = out, pace, 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.ran += 1
        if trainer.global_rank == 0:
            (self.out / "step").write_text(str(trainer.global_step))
        time.sleep(self.pace)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    world = args.devices * args.nodes
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[t], min_partition=4) for f, t in TYPES.items()}
    strategy = ShardRecStrategy(
        constraints=constraints,
        heartbeat_timeout=args.heartbeat_timeout,
        comm_transport="auto",  # shm inside each
    )
    progress = Progress(args.out, args.pace)
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=5, save_top_k=-1, save_last=True)
    t = trainer(
        strategy=strategy,
        devices=args.devices,
        num_nodes=args.nodes,
        max_steps=args.steps,
        callbacks=[checkpoints, progress],
        enable_checkpointing=True,
    )
    torch.set_num_threads(1)
    t.fit(Rec("adagrad"), data(GLOBAL_BATCH // world, args.steps), ckpt_path="last" if args.resume else None)
    state = strategy.full_state_dict()
    if t.global_rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, args.out / "final.pt")
        (args.out / "ran").write_text(str(progress.ran))


if __name__ == "__main__":
    main()
