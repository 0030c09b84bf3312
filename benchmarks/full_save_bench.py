"""Memory of a full-format save: each rank's peak over fit during ``save_checkpoint`` (issue 29).

    python benchmarks/full_save_bench.py [--rows 6000000] [--tables 2] [--label after] [--rounds 3]

The model of ``trainer_memory_bench.py`` (``--tables`` tables of ``rows x 16`` fp32, Adagrad, so the
fused state is as large as the tables), built under ``trainer.init_module()``, row-wise on 2 ranks
through ``Trainer(strategy=ShardRecStrategy(checkpoint_format="full"))``; after 2 steps,
``trainer.save_checkpoint`` writes one file from rank 0. Per rank: the share (its shards and their
state), the save's peak (``VmHWM`` restarted after fit) over the resident memory after fit, next
to the largest single tensor the file holds (one table's weight, ``rows x 16 x 4`` bytes). Prints
a markdown table row per rank (``--label`` names the code measured, e.g. ``before``/``after``).

``--rounds N`` then times ``save_checkpoint`` (rank 0's wall clock, after a barrier) N times with the
zip CRC-32s written and N times without (``torch.serialization.set_crc32_options(False)``), in turns
(on/off, then off/on, after a pair not counted) in the same processes. It prints each one's median,
the paired ratio, and the seconds the CRC-32s themselves took in each save (``zlib.crc32`` timed where
the checkpoint code calls it): writing the file (the kernel holds back writers while it flushes
dirty pages) makes whole saves vary far more than that.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_model  # noqa: E402
from trainer_memory_bench import MIB, Meter, _model  # noqa: E402


class _TimedZlib:
    """``zlib`` as :mod:`lightning_shardrec.checkpoint.zip_crc` uses it, adding up the seconds in ``crc32``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def crc32(self, data: Any, value: int = 0) -> int:
        start = time.perf_counter()
        try:
            return zlib.crc32(data, value)
        finally:
            self.seconds += time.perf_counter() - start


def _timed_saves(trainer: Any, path: str, rounds: int) -> dict[str, list[float]]:
    """Seconds of ``trainer.save_checkpoint(path)`` with and without zip CRC-32s, ``rounds`` each, in turns;
    ``"in_crc32"``: the seconds spent computing them in each save that wrote them."""
    import torch

    from lightning_shardrec.checkpoint import zip_crc

    times: dict[str, list[float]] = {"crc": [], "no_crc": [], "in_crc32": []}
    timed = zip_crc.zlib = _TimedZlib()  # type: ignore[assignment]
    try:
        for r in range(-1, rounds):  # round -1: a pair not counted (the first saves after fit run slow)
            for crc in (True, False) if r % 2 == 0 else (False, True):
                torch.serialization.set_crc32_options(crc)
                trainer.strategy.barrier()
                timed.seconds, start = 0.0, time.perf_counter()
                trainer.save_checkpoint(path)
                if r >= 0:
                    times["crc" if crc else "no_crc"].append(time.perf_counter() - start)
                    times["in_crc32"] += [timed.seconds] if crc else []
    finally:
        torch.serialization.set_crc32_options(True)
        zip_crc.zlib = zlib
    return times


def run_rank(rank: int, world: int, rows: int, tables: int, path: str, rounds: int = 0) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    launched = {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": rank, "NODE_RANK": 0, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in launched.items()}, MASTER_ADDR="127.0.0.1")  # as torchrun would
    os.environ.setdefault("MASTER_PORT", "29500")
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, rows, (8, tables, 2), generator=g), torch.rand(8, generator=g).round())] * 2
    rowwise = ParameterConstraints(sharding_types=["row_wise"])
    strategy = ShardRecStrategy(constraints={f"t{i}": rowwise for i in range(tables)}, checkpoint_format="full")
    quiet = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
    t = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=2, use_distributed_sampler=False, **quiet
    )
    with t.init_module():
        model = _model(rows, tables)()
    t.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    meter = Meter()  # the baseline: resident after fit (the share, the process)
    t.save_checkpoint(path)
    meter.mark("save")
    held = 0
    for coll in strategy.sharded.values():
        held += sum(w.numel() * w.element_size() for shards in coll.local_shards().values() for _, w in shards)
        for states in coll.local_states().values():
            held += sum(x.numel() * x.element_size() for _, s in states for x in s.values())
    size = os.path.getsize(path) if rank == 0 else 0
    return {"held": held, "save_peak": meter.phases["save"][0], "size": size, "times": _timed_saves(t, path, rounds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=6_000_000)
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--label", default="this tree")
    p.add_argument("--rounds", type=int, default=0, help="then time N saves with and N without zip CRC-32s")
    args = p.parse_args()
    from lightning_shardrec.testing import run_ranks

    root = Path(tempfile.mkdtemp(prefix="shardrec_full_save_"))
    try:
        ranks = run_ranks(run_rank, 2, args.rows, args.tables, str(root / "full.ckpt"), args.rounds, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tensor = args.rows * 16 * 4
    print(f"{args.tables} tables of {args.rows:,} x 16 fp32 + Adagrad, 2 ranks, {cpu_model()}, {os.cpu_count()} cores")
    print("| code | rank | share | largest tensor | save peak over fit | file |")
    print("|---|---|---|---|---|---|")
    for r, res in enumerate(ranks):
        print(
            f"| {args.label} | {r} | {res['held'] / MIB:.0f} MiB | {tensor / MIB:.0f} MiB | "
            f"{res['save_peak'] / MIB:.1f} MiB | {res['size'] / MIB:.0f} MiB |"
            if r == 0
            else f"| {args.label} | {r} | {res['held'] / MIB:.0f} MiB | | {res['save_peak'] / MIB:.1f} MiB | |"
        )

    times = ranks[0]["times"]
    if times["crc"]:
        ratios = [a / b for a, b in zip(times["crc"], times["no_crc"], strict=True)]
        print(f"\nsave_checkpoint on rank 0, {args.rounds} rounds each, in turns (seconds: median, min-max)")
        print("| zip CRC-32s written | not written | paired ratio written/not | of which computing the CRC-32s |")
        print("|---|---|---|---|")
        on, off, inside = (
            f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
            for v in (times["crc"], times["no_crc"], times["in_crc32"])
        )
        ratio = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"| {on} | {off} | {ratio} | {inside} |")


if __name__ == "__main__":
    main()
