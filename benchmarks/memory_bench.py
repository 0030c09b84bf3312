"""Sharded memory: per-rank bytes of the tables (and their optimizer state) of a model
built on ``device="meta"`` and sharded over W ranks, against total / W.

    python benchmarks/memory_bench.py [--configs rowwise_adagrad:2500000,adagrad:1250000]
        [--tables 8] [--dim 64] [--quick] [--write-docs docs/benchmarks.md]

The model (an ``EmbeddingBagCollection`` of ``--tables`` tables of ROWS x ``--dim``
fp32 under a wrapper module; one run per ``--configs`` item) is built on the meta
device in every rank, so nothing is allocated unsharded; ``DistributedModelParallel``
then allocates and initialises only the rank's shards. Two hand-written plans:
table-wise (tables dealt round-robin) and row-wise (every table cut into W equal row
blocks). Ranks come from
:func:`lightning_shardrec.testing.run_ranks` (gloo, CPU).

Per rank and plan: table bytes (``dmp.local_shards()``), optimizer-state bytes
(``dmp.fused_optimizer.state``), their ratio to (total tables + total state) / W,
the RSS before building, after building and after one training step, and the peak
RSS during build + step (``VmHWM``, reset through ``/proc/self/clear_refs`` before
each plan, since the rank processes are reused). ``--write-docs`` replaces only the
``## Sharded memory`` section of the given markdown file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from harness import replace_section  # noqa: E402
from torch import nn

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimConfig,
    KeyedJaggedTensor,
)
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.distributed import DistributedModelParallel
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.testing import run_ranks

SECTION = "## Sharded memory"
GIB = 2**30


def proc_status() -> dict[str, int]:
    """``VmRSS``/``VmHWM`` of this process in bytes (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Model(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables, device="meta")

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


def tables_of(num_tables: int, rows: int, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"]
        )
        for i in range(num_tables)
    ]


def make_plan(kind: str, tables: list[EmbeddingBagConfig], world: int) -> ShardingPlan:
    out = {}
    for i, t in enumerate(tables):
        rows, dim = t.num_embeddings, t.embedding_dim
        if kind == "table_wise":
            shards = [ShardMetadata((0, 0), (rows, dim), i % world)]
        elif kind == "row_wise":
            bounds = [rows * r // world for r in range(world + 1)]
            shards = [
                ShardMetadata((a, 0), (b - a, dim), r)
                for r, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
            ]
        else:
            raise ValueError(
                f"memory_bench: unknown plan kind {kind!r}; available: table_wise, row_wise"
            )
        out[t.name] = ParameterSharding(
            ShardingType(kind), EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards
        )
    return ShardingPlan({"ebc": out})


def measure(
    rank: int,
    world: int,
    kind: str,
    num_tables: int,
    rows: int,
    dim: int,
    optimizer: str,
    batch: int,
) -> dict[str, object]:
    """One rank: build the meta model, shard it, take one step; bytes and RSS."""

    gc.collect()
    peak_reset = reset_peak()
    before = proc_status()
    tables = tables_of(num_tables, rows, dim)
    model = Model(tables)
    t0 = time.perf_counter()
    dmp = DistributedModelParallel(
        model,
        plan=make_plan(kind, tables, world),
        device="cpu",
        embedding_optimizer=FusedOptimConfig(optimizer=EmbOptimType.parse(optimizer), lr=0.01),
    )
    build_s = time.perf_counter() - t0
    after_build = proc_status()
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 9, (num_tables * batch,), generator=g)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor([f"f{i}" for i in range(num_tables)], ids, lengths=lengths)
    dmp(kjt).sum().backward()
    after_step = proc_status()

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    shards = dmp.local_shards()
    table_bytes = sum(nbytes(w) for v in shards.values() for _, w in v)
    state_bytes = sum(
        nbytes(t) for s in dmp.fused_optimizer.state.values() for t in s.values() if t.dim() > 0
    )
    held = {k.split(".")[-2]: [tuple(m.shard_sizes) for m, _ in v] for k, v in shards.items()}
    del dmp, model, shards
    gc.collect()
    return {
        "rank": rank,
        "table_bytes": table_bytes,
        "state_bytes": state_bytes,
        "held": held,
        "rss_before": before["VmRSS"],
        "rss_built": after_build["VmRSS"],
        "rss_step": after_step["VmRSS"],
        "peak": after_step["VmHWM"]
        if peak_reset
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_reset": peak_reset,
        "build_s": build_s,
    }


def run(
    configs: list[tuple[str, int]],
    num_tables: int,
    dim: int,
    world: int,
    batch: int,
    plans: tuple[str, ...] = ("table_wise", "row_wise"),
) -> dict[str, Any]:
    """Every ``(optimizer, rows per table)`` config x every plan, on ``world`` ranks."""

    torch.set_num_threads(1)
    parent_before = proc_status()["VmRSS"]
    runs = []
    for optimizer, rows in configs:
        per_row = EmbOptimType.parse(optimizer).state_per_row(dim)
        results = {
            kind: run_ranks(
                measure, world, kind, num_tables, rows, dim, optimizer, batch, timeout=900.0
            )
            for kind in plans
        }
        runs.append(
            {
                "optimizer": optimizer,
                "rows": rows,
                "total_tables": num_tables * rows * dim * 4,
                "total_state": num_tables * rows * per_row * 4,
                "results": results,
            }
        )
    return {
        "runs": runs,
        "world": world,
        "num_tables": num_tables,
        "dim": dim,
        "batch": batch,
        "parent_before": parent_before,
        "parent_after": proc_status()["VmRSS"],
        "parent_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def gib(x: float) -> str:
    return f"{x / GIB:.3f}"


def run_table(run: dict[str, Any], num_tables: int, dim: int, world: int) -> list[str]:
    total = run["total_tables"] + run["total_state"]
    share = total / world
    lines = [
        f"**{num_tables} x {run['rows']:,} x {dim} fp32, {run['optimizer']}**: tables "
        f"{gib(run['total_tables'])} GiB + state {gib(run['total_state'])} GiB = {gib(total)} GiB; "
        f"total / W = {gib(share)} GiB.",
        "",
        "| plan | rank | shards held | tables GiB | state GiB | mine / (total/W) "
        "| RSS before | after build | after step | peak | (peak - before) / mine | build s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, ranks in run["results"].items():
        for x in ranks:
            mine = x["table_bytes"] + x["state_bytes"]
            shapes: dict[tuple[int, int], int] = {}
            for v in x["held"].values():
                for shape in v:
                    shapes[shape] = shapes.get(shape, 0) + 1
            held = ", ".join(f"{k} x [{a:,}, {b}]" for (a, b), k in shapes.items())
            over = (x["peak"] - x["rss_before"]) / mine if mine else float("nan")
            lines.append(
                f"| {kind} | {x['rank']} | {held} | {gib(x['table_bytes'])} "
                f"| {gib(x['state_bytes'])} | {mine / share:.4f} | {gib(x['rss_before'])} "
                f"| {gib(x['rss_built'])} | {gib(x['rss_step'])} | {gib(x['peak'])} "
                f"| {over:.2f} | {x['build_s']:.1f} |"
            )
    return lines + [""]


def report(r: dict[str, Any], cmd: str) -> str:
    world = r["world"]
    lines = [
        SECTION,
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}; {world} gloo ranks on "
        "CPU spawned by `run_ranks`, 1 thread each. "
        f"Date: {datetime.date.today().isoformat()}.  ",
        f'Model: one `EmbeddingBagCollection` built on `device="meta"` in every rank; kernel '
        f"auto (fbgemm on CPU); one fwd+bwd step of batch {r['batch']} per rank after building.  ",
        "Bytes: exact element counts of `dmp.local_shards()` and `dmp.fused_optimizer.state` "
        "(mine = tables + state of the rank). RSS in GiB from `/proc/self/status`; peak = "
        "`VmHWM`, reset before each plan, over build + step. One measurement per rank (byte "
        "counts are deterministic; RSS moves by a few MiB between runs). Build time is mostly "
        "page faults (system time) and says more about the VM than the plan: whichever plan "
        "is built first in fresh rank processes has been 5-15x slower than later ones.",
        "",
    ]
    for run in r["runs"]:
        lines += run_table(run, r["num_tables"], r["dim"], world)
    lines += [
        f"Parent process (builds nothing): RSS {gib(r['parent_before'])} GiB before, "
        f"{gib(r['parent_after'])} GiB after, peak {gib(r['parent_peak'])} GiB.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace (or append) this script's section of ``docs/benchmarks.md``; keep a ``Reading:``."""
    replace_section(path, SECTION, text)
def parse_configs(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        optimizer, _, rows = item.partition(":")
        if not rows.isdigit():
            raise SystemExit(f"--configs: expected OPTIMIZER:ROWS items, got {item!r}")
        out.append((optimizer, int(rows)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        default="rowwise_adagrad:2500000,adagrad:1250000",
        help="OPTIMIZER:ROWS_PER_TABLE items (default: 4.8 GiB of tables with a tiny state, "
        "then 2.4 GiB of tables with an equal adagrad state)",
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--plans", default="table_wise,row_wise", help="comma-separated, in order")
    p.add_argument("--quick", action="store_true", help="tiny model (20,000 rows, dim 16)")
    p.add_argument("--write-docs", type=Path, default=None)
    a = p.parse_args(argv)
    configs = parse_configs(a.configs)
    if a.quick:
        configs, a.dim, a.batch_size = [("rowwise_adagrad", 20_000), ("adagrad", 20_000)], 16, 32
    plans = tuple(a.plans.split(","))
    r = run(configs, a.tables, a.dim, a.world_size, a.batch_size, plans)
    cmd = "python benchmarks/memory_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(r, cmd.strip())
    print(text)
    if a.write_docs is not None:
        write_section(a.write_docs, text)


if __name__ == "__main__":
    main()
