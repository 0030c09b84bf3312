"""Kernel throughput: forward + backward (with the fused row update) of the batched
embedding kernels, fbgemm and torch, against the machine's memory bandwidth.

    python benchmarks/kernel_bench.py [--repeats 11] [--batches 16] [--quick]
        [--write-docs docs/benchmarks.md]

Workload (issue 10's shape, from :mod:`lightning_shardrec.data.synthetic`): 8 tables,
4 x 200,000 and 4 x 20,000 rows, dim 64, fp32, batch 1024, ~8 power-law ids per bag.
Batches and output gradients are generated before timing; one warm-up pass per case
is not timed. Each repeat times every case once (in a shuffled order) over the same batches,
so cases are compared side by side; the table reports the median over repeats and
the spread (min..max), and each case's GB/s as a fraction of the copy bandwidth
measured in the same repeat (paired, which cancels slow phases of a shared
machine). One intra-op thread.

Definitions (per timed pass over the batches, ``N`` ids looked up, ``D`` = 64, fp32):

- rows/s = ``N`` / seconds.
- bytes of rows touched = ``3 * N * D * 4``: forward reads each id's row once,
  backward reads and writes it once (gradients, optimizer state and the kernels'
  de-duplication of repeated ids are not counted), so GB/s = that / seconds.
- bandwidth references, same run: ``torch.index_select`` of the same ``N`` rows
  from a flat table of all 8 tables (counted as ``2 * N * D * 4``: rows read +
  output written) and a plain ``copy_`` of a 256 MiB tensor (``2 * size``).
  "% of copy" = kernel GB/s / copy GB/s of the same repeat (median, min..max).
- ``validate_ids``: ``EmbeddingBagCollection`` forward (unsharded, no grad) with the
  id-range check on vs off, the two collections alternating batch by batch;
  cost = (on - off) / off per repeat; and the check function alone.

``--write-docs`` replaces only this machine's part (``### <CPU model> (<ISA>)``) of the
``## Kernels`` section of the given markdown file; other machines' figures stay.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import torch
from harness import Stat, machine_heading, replace_machine_section  # noqa: E402

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimConfig
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.data.synthetic import (
    SyntheticRecGenerator,
    SyntheticSpec,
    benchmark_tables,
    to_features,
)
from lightning_shardrec.kernels import TableSpec, make_kernel, native
from lightning_shardrec.modules.features import check_ids
from lightning_shardrec.sparse import KeyedJaggedTensor

SECTION = "## Kernels"
DIM = 64
BYTES = 4  # fp32

# (backend, optimizer): fbgemm's CPU TBE trains only the exact_* rules, so no adam there. "torch-ops": the torch
# kernel without its compiled loops (kernels/native_rows.c), as a package built without a C compiler runs it.
TENSOR_OPS = "torch-ops"
CASES = [
    ("fbgemm", "sgd"),
    ("fbgemm", "rowwise_adagrad"),
    ("torch", "sgd"),
    ("torch", "rowwise_adagrad"),
    ("torch", "adam"),
    (TENSOR_OPS, "rowwise_adagrad"),
]


@contextlib.contextmanager
def loops_off(backend: str) -> Iterator[None]:
    """While a ``torch-ops`` case runs, the torch kernel finds no compiled loops (its tensor ops run)."""
    if backend != TENSOR_OPS:
        yield
        return
    real = native.row_loops
    native.row_loops = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        native.row_loops = real


def workload_tables(shrink: int = 1) -> list[EmbeddingBagConfig]:
    """The benchmark tables (``benchmark_tables``), rows divided by ``shrink`` (``--quick``)."""
    return [replace(t, num_embeddings=t.num_embeddings // shrink) for t in benchmark_tables(DIM)]


def make_batches(
    tables: list[EmbeddingBagConfig], batch_size: int, num_batches: int
) -> list[KeyedJaggedTensor]:
    gen = SyntheticRecGenerator(SyntheticSpec(features=to_features(tables), num_dense=0))
    return [gen.global_batch(i, batch_size).sparse for i in range(num_batches)]


def build_kernel(
    backend: str, optimizer: str, tables: list[EmbeddingBagConfig], weights: list[torch.Tensor]
) -> torch.nn.Module:
    specs = [
        TableSpec(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim)
        for t in tables
    ]
    kernel = make_kernel(
        specs,
        list(range(len(specs))),
        FusedOptimConfig(optimizer=EmbOptimType.parse(optimizer), lr=1e-3),
        pooled=True,
        device="cpu",
        kernel="torch" if backend == TENSOR_OPS else backend,
    )
    kernel.load_weights(weights)  # same initialised rows for every case
    return kernel


def train_pass(
    kernel: torch.nn.Module, batches: list[KeyedJaggedTensor], grads: list[torch.Tensor]
) -> None:
    for kjt, g in zip(batches, grads, strict=True):
        kernel(kjt).backward(g)


def forward_pass(kernel: torch.nn.Module, batches: list[KeyedJaggedTensor]) -> None:
    with torch.no_grad():
        for kjt in batches:
            kernel(kjt)


def run(
    batch_size: int, num_batches: int, repeats: int, shrink: int = 1, copy_mib: int = 256
) -> dict[str, object]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tables = workload_tables(shrink)
    batches = make_batches(tables, batch_size, num_batches)
    n_ids = sum(int(b.values().numel()) for b in batches)
    # Unique (table, id) pairs per batch over ids per batch: what de-duplication saves.
    fracs = []
    for b in batches:
        per_key = [k.values() for k in b.split([1] * len(b.keys()))]
        fracs.append(
            sum(int(torch.unique(v).numel()) for v in per_key) / max(1, int(b.values().numel()))
        )
    unique = statistics.mean(fracs)

    weights = [torch.empty(t.num_embeddings, DIM).uniform_(-0.01, 0.01) for t in tables]
    out_dim = len(tables) * DIM
    grads = [torch.randn(batch_size, out_dim) * 1e-3 for _ in batches]

    kernels = {case: build_kernel(*case, tables, weights) for case in CASES}
    # Bandwidth references: the same ids as flat-table row indices, and a big copy.
    flat = torch.cat(weights, 0)
    row_base = torch.tensor([0] + [t.num_embeddings for t in tables]).cumsum(0)[:-1]
    flat_ids = [
        b.values().long() + row_base.repeat_interleave(torch.tensor(b.length_per_key()))
        for b in batches
    ]
    src = torch.empty(copy_mib * 2**20 // BYTES).uniform_()
    dst = torch.empty_like(src)
    ebcs = {v: EmbeddingBagCollection(tables, validate_ids=v) for v in (True, False)}
    with torch.no_grad():
        for t, w in zip(tables, weights, strict=True):
            for e in ebcs.values():
                e.embedding_bags[t.name].weight.copy_(w)  # type: ignore[operator]

    def gather() -> None:
        for ids in flat_ids:
            flat.index_select(0, ids)

    ebc_seconds: dict[bool, list[float]] = {True: [], False: []}

    def ebc_pair() -> None:
        """EBC forward with validate_ids on and off, alternating per batch (tightly paired)."""
        on_off = {True: 0.0, False: 0.0}
        with torch.no_grad():
            for i, kjt in enumerate(batches):
                for v in (True, False) if i % 2 else (False, True):
                    t = time.perf_counter()
                    ebcs[v](kjt)
                    on_off[v] += time.perf_counter() - t
        for v, sec in on_off.items():
            ebc_seconds[v].append(sec)

    def copy() -> None:
        dst.copy_(src)

    def train(k: torch.nn.Module, backend: str) -> Callable[[], None]:
        def run() -> None:
            with loops_off(backend):
                train_pass(k, batches, grads)

        return run

    def forward(k: torch.nn.Module, backend: str) -> Callable[[], None]:
        def run() -> None:
            with loops_off(backend):
                forward_pass(k, batches)

        return run

    jobs: dict[str, Callable[[], None]] = {"gather": gather, "copy": copy}
    for (backend, optimizer), k in kernels.items():
        jobs[f"train {backend} {optimizer}"] = train(k, backend)
    for backend, optimizer in (("fbgemm", "sgd"), ("torch", "sgd"), (TENSOR_OPS, "rowwise_adagrad")):
        jobs[f"forward {backend}"] = forward(kernels[(backend, optimizer)], backend)
    jobs["ebc validate_ids on/off"] = ebc_pair
    rows_of = [t.num_embeddings for t in tables]
    names_of = [t.name for t in tables]

    def check_alone() -> None:
        for kjt in batches:
            check_ids(kjt, rows_of, names_of)

    jobs["check_ids alone"] = check_alone

    for fn in jobs.values():  # warm-up, not timed
        fn()
    for v in ebc_seconds:
        ebc_seconds[v].clear()
    seconds: dict[str, list[float]] = {name: [] for name in jobs}
    order = list(jobs)
    shuffle = random.Random(0)
    for _ in range(repeats):
        shuffle.shuffle(order)  # a burst of noise hits a different case each repeat
        for name in order:
            seconds[name].append(harness.seconds(jobs[name]))
    seconds["ebc validate_ids=True"] = ebc_seconds[True]
    seconds["ebc validate_ids=False"] = ebc_seconds[False]
    cost = [
        100.0 * (on - off) / off
        for on, off in zip(ebc_seconds[True], ebc_seconds[False], strict=True)
    ]
    return {
        "seconds": seconds,
        "n_ids": n_ids,
        "unique": unique,
        "copy_bytes": 2 * src.numel() * BYTES,
        "copy_mib": copy_mib,
        "validate_cost": Stat(cost),
        "batch_size": batch_size,
        "rows": " + ".join(f"4 x {n:,}" for n in dict.fromkeys(t.num_embeddings for t in tables))
        + " rows",
        "num_batches": num_batches,
        "repeats": repeats,
    }


def machine() -> str:
    import fbgemm_gpu  # noqa: PLC0415 - only for its version string

    return f"{harness.machine()}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}, 1 thread"


def report(r: dict[str, Any], cmd: str) -> str:
    sec: dict[str, list[float]] = r["seconds"]
    n, nb, bs = int(r["n_ids"]), int(r["num_batches"]), int(r["batch_size"])
    mib = r["copy_mib"]
    copy_gbs = Stat([r["copy_bytes"] / s / 1e9 for s in sec["copy"]])
    gather_gbs = Stat([2 * n * DIM * BYTES / s / 1e9 for s in sec["gather"]])

    def paired(gbs: Stat) -> Stat:
        """Percent of the copy bandwidth of the same repeat."""
        return Stat([100 * a / b for a, b in zip(gbs.values, copy_gbs.values, strict=True)])

    def fmt(st: Stat, spec: str) -> str:
        return f"{st.median:{spec}} | {st.lo:{spec}}..{st.hi:{spec}}"

    def ms_per_batch(name: str) -> float:
        return statistics.median(sec[name]) * 1e3 / nb

    lines = [
        SECTION,
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}. Date: {datetime.date.today().isoformat()}.  ",
        f"Workload: 8 tables ({r['rows']}, dim {DIM}, fp32), batch {bs}, {nb} pre-generated "
        f"batches per pass ({n:,} ids, {n / nb / bs / 8:.2f} ids per bag; unique ids per batch "
        f"= {100 * r['unique']:.0f}% of ids, zipf 1.05). Median of {r['repeats']} passes, "
        "spread = min..max; all cases timed in each repeat, in a shuffled order.  ",
        "Rows touched = 3 x ids x 64 x 4 B (forward read + backward read and write of each "
        "id's row; optimizer state, gradients and de-duplication not counted). Bandwidth "
        "references: `index_select` of the same rows from one flat table (2 x ids x 64 x 4 B) "
        f"and `copy_` of {mib} MiB (2 x {mib} MiB).",
        "",
        "| case | M ids/s (median) | spread | GB/s rows touched | spread "
        "| % of copy GB/s (paired) | spread |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in sec:
        if not name.startswith(("train", "forward")):
            continue
        factor = 3 if name.startswith("train") else 1
        ids = Stat([n / s / 1e6 for s in sec[name]])
        gbs = Stat([factor * n * DIM * BYTES / s / 1e9 for s in sec[name]])
        label = name.replace("train ", "fwd+bwd+update ")
        label = label.replace("forward ", "forward only (no grad) ")
        lines.append(
            f"| {label} | {fmt(ids, ',.2f')} | {fmt(gbs, '.2f')} | {fmt(paired(gbs), '.0f')} |"
        )
    gather_ids = Stat([n / s / 1e6 for s in sec["gather"]])
    cost: Stat = r["validate_cost"]
    on, off = ms_per_batch("ebc validate_ids=True"), ms_per_batch("ebc validate_ids=False")
    step = ms_per_batch("train fbgemm rowwise_adagrad")
    lines += [
        f"| reference: `index_select` gather, same ids | {fmt(gather_ids, ',.2f')} "
        f"| {fmt(gather_gbs, '.2f')} | {fmt(paired(gather_gbs), '.0f')} |",
        f"| reference: `copy_` {mib} MiB | - | - | {fmt(copy_gbs, '.2f')} | 100 | - |",
        "",
        "Forward-only rows count 1 x ids x 64 x 4 B.",
        "",
        "`kernel=\"auto\"` on these tables (all 8 in one group, batch "
        f"{bs}, 8 ids per bag), timed afresh: "
        + "; ".join(f"{o}: {c}" for o, c in r.get("auto", {}).items())
        + ".",
        "",
        "`validate_ids` on an unsharded `EmbeddingBagCollection` forward (same batches, no "
        f"grad): on {on:.2f} ms/batch, off {off:.2f} ms/batch; cost {cost.median:+.1f}% "
        f"(spread {cost.lo:+.1f}..{cost.hi:+.1f}% over repeats; on and off alternate batch by "
        "batch). The difference, "
        f"{on - off:.2f} ms/batch, is {100 * (on - off) / step:.0f}% of an fbgemm rowwise_adagrad "
        f"fwd+bwd+update of the same batch ({step:.2f} ms). The check on its own "
        f"(`modules.features.check_ids`, same batches): {ms_per_batch('check_ids alone'):.2f} "
        "ms/batch.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace (or add) this machine's part (``### <CPU model> (<ISA>)``) of this script's section of
    ``docs/benchmarks.md``; other machines' figures stay beside it; keep its ``Reading:``."""
    body = text.split("\n", 1)[1].lstrip("\n") if text.startswith(SECTION) else text
    replace_machine_section(path, SECTION, machine_heading(), body)
def auto_choices(tables: list[EmbeddingBagConfig], batch_size: int) -> dict[str, str]:
    """What ``kernel="auto"`` picks for these tables per optimizer, timed afresh (cache off)."""
    import os

    from lightning_shardrec.kernels import Workload, autotune, choose

    specs = [TableSpec(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim) for t in tables]
    os.environ[autotune.CACHE_ENV] = "off"
    out = {}
    for optimizer in ("sgd", "adagrad", "rowwise_adagrad"):
        start = time.perf_counter()
        choice = choose(
            specs, list(range(len(specs))), FusedOptimConfig(optimizer=EmbOptimType.parse(optimizer)),
            pooled=True, device="cpu", workload=Workload(batch_size=batch_size, pooling=8.0),
        )  # fmt: skip
        out[optimizer] = f"{choice.label()}, timed in {time.perf_counter() - start:.2f} s"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--batches", type=int, default=16, help="pre-generated batches per timed pass")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument(
        "--copy-mib", type=int, default=256, help="size of the plain-copy bandwidth reference"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tables 1/10 the rows, 2 batches of 128, 2 repeats",
    )
    p.add_argument("--write-docs", type=Path, default=None)
    a = p.parse_args(argv)
    shrink = 1
    if a.quick:
        a.batch_size, a.batches, a.repeats, shrink, a.copy_mib = 128, 2, 2, 10, 16
    r = run(a.batch_size, a.batches, a.repeats, shrink, a.copy_mib)
    r["auto"] = auto_choices(workload_tables(shrink), a.batch_size)
    cmd = "python benchmarks/kernel_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(r, cmd.strip())
    print(text)
    if a.write_docs is not None:
        write_section(a.write_docs, text)


if __name__ == "__main__":
    main()
