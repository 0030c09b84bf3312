"""Each collective's share of a training step on the process group (issue 42), 2 and 3 gloo ranks.

    python benchmarks/comm_share.py [--worlds 2,3] [--steps 30] [--warmup 5] [--batch-size 1024] [--quick]

The anchor workload of ``e2e_bench.py`` (8 tables, 4 x 200,000 + 4 x 20,000 rows, dim 64, row-wise
Adagrad; the same MLPs), random ids (~8 per bag), our ``DistributedModelParallel`` in a plain loop,
``comm_transport="pg"``, one intra-op thread per rank. Every ``torch.distributed`` collective is
timed at its call site: a blocking call for its whole duration, an async one for its issue plus its
``wait()`` (the time the rank stood still for it, the wait for the slowest rank included). Sites:
``header`` (batch sizes and id counts), ``ids`` (lengths + ids + weights), ``pooled`` (the
pooled rows' all-to-all or reduce-scatter), ``grads`` (their gradients). DDP's dense all-reduce
runs inside its C++ reducer, overlapped with backward, and is not a site here. Prints per world
size the median ms per step of each site and its share of the median step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SITES = {  # (file, function) -> site
    ("batch_dist.py", "distribute_inputs"): "header",
    ("batch_dist.py", "start_input_dist"): "header",
    ("input_dist.py", "exchange_packed_async"): "ids",
    ("input_dist.py", "exchange_async"): "ids",
    ("pooled_all_to_all.py", "forward"): "pooled",
    ("pooled_all_to_all.py", "backward"): "grads",
    ("row_blocks.py", "output_dist"): "pooled",
}


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        key = (os.path.basename(frame.filename), frame.name)
        if key in SITES:
            return SITES[key]
        if "comm.py" in frame.filename and frame.name == "backward":
            return "grads"
    return "other"


class _Timed:
    """A ``Work`` whose ``wait()`` adds to its site's time."""

    def __init__(self, work: Any, site: str, times: dict[str, float]) -> None:
        self._work, self._site, self._times = work, site, times

    def wait(self, *args: Any) -> bool:
        t = time.perf_counter()
        try:
            return self._work.wait(*args)
        finally:
            self._times[self._site] += time.perf_counter() - t


def _instrument(times: dict[str, float]) -> None:
    import torch.distributed as dist

    for name in ("all_to_all_single", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single"):
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def timed(*args: Any, _orig: Any = orig, **kw: Any) -> Any:
            site = _site()
            t = time.perf_counter()
            work = _orig(*args, **kw)
            times[site] += time.perf_counter() - t
            return _Timed(work, site, times) if work is not None else None

        setattr(dist, name, timed)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _e2e_common import EPS, LR, NUM_DENSE, NUM_TABLES, TABLE_ROWS
    from _e2e_workers import _bench_model

    from lightning_shardrec import DistributedModelParallel, FusedOptimConfig, KeyedJaggedTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    b = args.batch_size
    config = FusedOptimConfig(optimizer="rowwise_adagrad", lr=LR, eps=EPS)
    model = DistributedModelParallel(
        _bench_model(args.shrink), embedding_optimizer=config, batch_size=b, comm_transport="pg"
    )
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=LR)
    g = torch.Generator().manual_seed(rank)
    times: dict[str, float] = defaultdict(float)
    _instrument(times)
    steps: list[dict[str, float]] = []
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    for i in range(args.warmup + args.steps):
        lengths = torch.randint(4, 13, (NUM_TABLES * b,), generator=g)
        rows = (torch.tensor(TABLE_ROWS) // args.shrink).repeat_interleave(b).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=g) ** 3 * rows).long()
        kjt = KeyedJaggedTensor(keys, values, lengths=lengths)
        dense, labels = torch.randn(b, NUM_DENSE, generator=g), torch.rand(b, generator=g).round()
        times.clear()
        t = time.perf_counter()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
        loss.backward()
        opt.step()
        if i >= args.warmup:
            steps.append({"step": time.perf_counter() - t, **times})
    out.write_text(json.dumps(steps))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--shrink", type=int, default=1, help="divide table rows by this (a smoke run)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, tables 1/100, batch 64, 1+3 steps")
    args = p.parse_args()
    if args.quick:
        args.worlds, args.shrink, args.batch_size, args.warmup, args.steps = "2", 100, 64, 1, 3
    import socket

    import torch.multiprocessing as mp

    print(f"load average {os.getloadavg()}")
    for world in [int(w) for w in args.worlds.split(",")]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"r{r}" for r in range(world)]
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=worker, args=(r, world, port, args, outs[r])) for r in range(world)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            per_rank = [json.loads(o.read_text()) for o in outs]
        step = statistics.median(max(r[i]["step"] for r in per_rank) for i in range(args.steps))
        print(f"{world} ranks: median step {step * 1e3:.1f} ms (the slowest rank's); per site, over steps x ranks:")
        for site in ("header", "ids", "pooled", "grads", "other"):
            ms = statistics.median(s.get(site, 0.0) for r in per_rank for s in r) * 1e3
            print(f"  {site:7s} {ms:7.2f} ms  {ms / (step * 1e3):6.1%}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
