"""Serving latency of the DLRM example: eager float vs eager quantized vs torch.export vs AOTInductor.

    python benchmarks/serving_bench.py [--requests 200] [--quick] [--write-docs docs/benchmarks.md]

Model: ``examples/dlrm/config.yaml``'s ``DLRMTask`` (dot interaction, dim 16, dense 13 ->
[64, 16], over [64, 1]) on the synthetic default tables (4 x 200,000 + 4 x 20,000 rows),
random init (latency does not depend on training). Requests: ``RecBatch``es from
``SyntheticRecDataModule`` (power-law ids, ~pooling factor 4 ids per bag) of batch 1, 64
and 512, a pool of distinct ones cycled.

Cases (one request = one forward under ``torch.inference_mode``, Python caller):

* eager float: the trained module as it is;
* eager int8: ``quantize(model, "int8")`` (fbgemm's integer TBE where it loads, else torch);
* pt2 int8: ``torch.export.load(...).module()`` of ``shardrec export --format pt2``;
* aoti int8: ``torch._inductor.aoti_load_package`` of ``--format aoti`` (C++ compiled).

Each case serves ``--requests`` requests per batch size after warm-up, with 1 intra-op thread
and with all cores (``torch.set_num_threads``); reported: p50 and p99 per request (ms) and
throughput (samples/s = batch * requests / their summed time). The cases run interleaved,
request by request in a shuffled order, so machine load hits them alike. ``--write-docs``
replaces this machine's part of ``## Serving latency`` (kept beside other machines').
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from harness import machine_heading, replace_machine_section

from lightning_shardrec import SyntheticRecDataModule
from lightning_shardrec.inference import quantize
from lightning_shardrec.inference.export import export
from lightning_shardrec.inference.program import plain_inputs
from lightning_shardrec.models import DLRMTask

HEADING = "## Serving latency"
BATCHES = (1, 64, 512)


def model(quick: bool) -> tuple[DLRMTask, list[dict[str, Any]]]:
    """The example's DLRMTask (random init, eval) and its data tables (features f0..f7)."""
    rows = (2_000, 200) if quick else (200_000, 20_000)
    data_tables = [{"name": f"f{i}", "num_embeddings": rows[0] if i < 4 else rows[1]} for i in range(8)]
    tables = [{"name": f"t_{t['name']}", "num_embeddings": t["num_embeddings"], "feature_names": [t["name"]]}
              for t in data_tables]  # fmt: skip
    task = DLRMTask(embedding_tables=tables, embedding_dim=16, num_dense=13, dense_arch_layer_sizes=[64, 16],
                    over_arch_layer_sizes=[64, 1], interaction="dot")  # fmt: skip
    return task.eval(), data_tables


def requests(tables: list[dict[str, Any]], batch: int, count: int) -> list[Any]:
    dm = SyntheticRecDataModule(num_dense=13, tables=tables, batch_size=batch, num_batches=1, val_batches=0,
                                test_batches=count, pooling_factor=4.0, seed=batch)  # fmt: skip
    dm.setup("test")
    return list(dm.test_dataloader())


def serve(cases: dict[str, Callable[[Any], Any]], reqs: list[Any], n: int, warmup: int) -> dict[str, list[float]]:
    """Per-request seconds of each case over ``n`` requests (cycled) after ``warmup``; request by
    request, the cases in a shuffled order, so machine load falls on all of them alike."""
    order = list(cases)
    times: dict[str, list[float]] = {name: [] for name in cases}
    rng = random.Random(0)
    with torch.inference_mode():
        for i in range(warmup + n):
            rng.shuffle(order)
            for name in order:
                t = time.perf_counter()
                cases[name](reqs[i % len(reqs)])
                if i >= warmup:
                    times[name].append(time.perf_counter() - t)
    return times


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="small tables, few requests, one thread, no AOTInductor")
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    task, tables = model(args.quick)
    n_req = 10 if args.quick else args.requests
    cases: dict[str, Callable[[Any], Any]] = {"eager float": task}
    quantized = quantize(task, "int8", inplace=False)
    cases["eager int8"] = quantized
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        export(None, task, "int8", Path(tmp) / "m.pt2", format="pt2")
        export_s = time.perf_counter() - start
        program = torch.export.load(Path(tmp) / "m.pt2").module()
        cases["pt2 int8"] = lambda b: program(*plain_inputs((b,)))
        aoti_s = None
        if not args.quick:
            start = time.perf_counter()
            export(None, task, "int8", Path(tmp) / "m_aoti.pt2", format="aoti")
            aoti_s = time.perf_counter() - start
            compiled = torch._inductor.aoti_load_package(str(Path(tmp) / "m_aoti.pt2"))
            cases["aoti int8"] = lambda b: compiled(*plain_inputs((b,)))
        threads_all = os.cpu_count() or 1
        rows = []
        for batch in BATCHES:
            reqs = requests(tables, batch, 8)
            with torch.inference_mode():  # the programs equal the eager quantized model on these requests
                want = quantized(reqs[0])
                for name in ("pt2 int8", "aoti int8"):
                    if name in cases:
                        torch.testing.assert_close(cases[name](reqs[0]), want, rtol=1e-5, atol=1e-5)
            for threads in [1] if args.quick else sorted({1, threads_all}):
                torch.set_num_threads(threads)
                n = max(5, n_req // (4 if batch == 512 else 1))
                for name, times in serve(cases, reqs, n, warmup=min(10, n)).items():
                    rows.append((batch, threads, name, 1e3 * p(times, 50), 1e3 * p(times, 99), batch * n / sum(times)))
        torch.set_num_threads(threads_all)
    cpu = machine_heading()
    lines = [
        f"`benchmarks/serving_bench.py` ({datetime.date.today()}, torch {torch.__version__}, {cpu}, "
        f"{threads_all} cores, loaded machine (8 engineers)). DLRM example (8 tables, "
        f"{'quick sizes' if args.quick else '4 x 200,000 + 4 x 20,000 rows'}, dim 16); export to pt2 took "
        f"{export_s:.1f} s" + ("" if aoti_s is None else f", to aoti {aoti_s:.0f} s") + ".",
        "",
        "| batch | threads | case | p50 ms | p99 ms | samples/s |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    lines += [f"| {b} | {t} | {name} | {p50:.3f} | {p99:.3f} | {tput:,.0f} |" for b, t, name, p50, p99, tput in rows]
    text = "\n".join(lines) + "\n"
    print(HEADING + "\n\n" + text)
    if args.write_docs is not None:
        replace_machine_section(args.write_docs, HEADING, cpu, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
