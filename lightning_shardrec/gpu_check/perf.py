"""Speed, host syncs and memory of the hot path on the device.

- copy bandwidth: ``dst.copy_(src)`` of ``copy_mib`` (read + write), the roof for row gathers;
- kernel throughput: the pooled lookup alone (ids/s, GB/s of rows read) and with the fused
  Adagrad update in backward, next to that bandwidth;
- dynamic vs static: one plain-loop DLRM step with dynamic tables, and with static ones;
- host syncs per step: counted by CUDA itself on a GPU (:func:`~.syncs.cuda_syncs`), by
  :class:`~.syncs.SyncOps` on CPU (the GPU's code path, forward and backward: the CPU's
  optimizer step reads its step counters on the host, which on a GPU stay on the host);
- memory: peak allocated over the static DLRM's build and steps next to the plan's estimate.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import Tensor

from lightning_shardrec import DistributedModelParallel, KeyedJaggedTensor
from lightning_shardrec.data import RecBatch
from lightning_shardrec.gpu_check.collections import Probe, fused_planner
from lightning_shardrec.gpu_check.env import Mode, gpu_code_path, median_seconds, one_rank_group
from lightning_shardrec.gpu_check.report import Check, Report, Status
from lightning_shardrec.gpu_check.syncs import SyncCount, SyncOps, cuda_syncs
from lightning_shardrec.gpu_check.trainer import plain_loop, step_batches, tables, train_step
from lightning_shardrec.modules import EmbeddingBagCollection

# Host syncs per training step (forward + backward) that the CPU-side count finds today, by path:
# static: the KJT's per-key lengths, the id range check, the batch header read, the backward's
# unique rows; dynamic adds the new rows' count per table and the all-hit test.
SYNC_BOUND = {"static": 4, "dynamic": 6}


def copy_bandwidth(mode: Mode) -> float:
    """GB/s of ``dst.copy_(src)`` (bytes read + written)."""
    n = mode.sizes.copy_mib * 2**20 // 4
    src, dst = torch.randn(n, device=mode.device), torch.empty(n, device=mode.device)
    seconds = median_seconds(lambda: dst.copy_(src), mode, 10, 2)
    return 2 * n * 4 / seconds / 1e9


def kernel_throughput(report: Report, mode: Mode, bandwidth: float) -> None:
    s = mode.sizes
    features = [f"f{i}" for i in range(4)]
    torch.manual_seed(0)
    from lightning_shardrec import EmbeddingBagConfig

    specs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=s.kernel_dim, num_embeddings=s.kernel_rows, feature_names=[f])
        for i, f in enumerate(features)
    ]
    coll = EmbeddingBagCollection(specs, device=torch.device("meta"))
    ids_n = len(features) * s.kernel_batch * s.kernel_pooling
    values = torch.randint(0, s.kernel_rows, (ids_n,), device=mode.device)
    lengths = torch.full((len(features) * s.kernel_batch,), s.kernel_pooling, device=mode.device)
    kjt = KeyedJaggedTensor(features, values, lengths=lengths)
    with one_rank_group(mode):
        dmp = DistributedModelParallel(
            Probe(coll, len(features) * s.kernel_dim),
            device=mode.device,
            kernel="torch",
            planner=fused_planner(mode.device, features, s.kernel_batch),
        )

        def forward() -> Tensor:
            with torch.no_grad():
                return dmp(kjt)

        def train() -> None:
            dmp(kjt).sum().backward()

        fwd = median_seconds(forward, mode, s.steps, s.warmup)
        both = median_seconds(train, mode, s.steps, s.warmup)
    row_bytes = ids_n * s.kernel_dim * 4
    figures = {
        "ids": ids_n,
        "dim": s.kernel_dim,
        "rows": s.kernel_rows,
        "forward_s": fwd,
        "train_s": both,
        "copy_gbps": bandwidth,
    }
    report.add(
        Check(
            "speed",
            "kernel lookup (pooled, forward)",
            Status.INFO,
            f"{ids_n / fwd / 1e6:.3g} M ids/s, {row_bytes / fwd / 1e9:.3g} GB/s of rows read "
            f"({100 * row_bytes / fwd / 1e9 / bandwidth:.0f}% of copy {bandwidth:.0f} GB/s)",
            figures,
        )
    )
    report.add(
        Check(
            "speed",
            "kernel lookup + fused adagrad (forward + backward)",
            Status.INFO,
            f"{ids_n / both / 1e6:.3g} M ids/s ({ids_n} ids of dim {s.kernel_dim}, "
            f"{len(features)} tables of {s.kernel_rows} rows)",
            figures,
        )
    )


def _next_step(dmp: torch.nn.Module, opt: torch.optim.Optimizer, batches: Iterator[RecBatch]) -> None:
    train_step(dmp, opt, next(batches))


def _count_step(mode: Mode, dmp: torch.nn.Module, opt: torch.optim.Optimizer, batch: object) -> SyncCount:
    if mode.cuda:
        with cuda_syncs() as count:
            train_step(dmp, opt, batch)  # type: ignore[arg-type]
        return count
    import torch.nn.functional as F

    with SyncOps() as count:  # forward + backward (see the module docstring)
        loss = F.binary_cross_entropy_with_logits(dmp(batch), batch.labels)  # type: ignore[attr-defined]
        loss.backward()
    opt.step()
    opt.zero_grad()
    return count


def steps_syncs_memory(report: Report, mode: Mode) -> None:
    """Dynamic vs static step time, host syncs per step of each, and the static run's peak memory."""
    s = mode.sizes
    seconds: dict[str, float] = {}
    for kind in ("static", "dynamic"):
        specs = tables(s.step_tables, s.step_rows, s.step_dim, dynamic=kind == "dynamic")
        batches = step_batches(mode, specs)
        if mode.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(mode.device)
        with one_rank_group(mode), gpu_code_path():
            dmp, opt = plain_loop(mode, specs)
            it = iter(batches)
            seconds[kind] = median_seconds(partial(_next_step, dmp, opt, it), mode, s.steps, s.warmup)
            count = _count_step(mode, dmp, opt, next(it))
            plan = dmp.plan
        where = ", ".join(f"{site} x{n}" for site, n in count.sites.most_common(8))
        status = Status.PASS if count.total <= SYNC_BOUND[kind] else Status.FAIL
        how = "CUDA's sync debug mode, whole step" if mode.cuda else "aten ops that sync on CUDA, forward + backward"
        report.add(
            Check(
                "syncs",
                f"{kind} tables, one training step",
                status,
                f"{count.total} host syncs (bound {SYNC_BOUND[kind]}; {how}): {where or 'none'}",
                {"total": count.total, "kinds": dict(count.kinds), "sites": dict(count.sites)},
            )
        )
        if kind == "static":
            _memory(report, mode, plan)
    ratio = seconds["dynamic"] / seconds["static"]
    report.add(
        Check(
            "speed",
            "DLRM step: dynamic vs static tables",
            Status.INFO,
            f"{seconds['dynamic'] * 1e3:.2f} ms vs {seconds['static'] * 1e3:.2f} ms ({ratio:.2f}x), "
            f"{s.step_tables} tables of {s.step_rows} rows x {s.step_dim}, batch {s.step_batch}",
            {"dynamic_s": seconds["dynamic"], "static_s": seconds["static"]},
        )
    )


def _memory(report: Report, mode: Mode, plan: object) -> None:
    stats = getattr(plan, "stats", None)
    estimate = float(stats.rank_storage[0]) if stats is not None else float("nan")
    if not mode.cuda:
        report.add(
            Check(
                "memory",
                "peak allocated vs the plan's estimate",
                Status.NOT_CHECKED,
                f"needs CUDA's allocator stats; the plan estimates {estimate / 2**20:.1f} MiB",
                {"estimate_bytes": estimate},
            )
        )
        return
    peak = torch.cuda.max_memory_allocated(mode.device)
    report.add(
        Check(
            "memory",
            "peak allocated vs the plan's estimate",
            Status.INFO,
            f"peak {peak / 2**30:.2f} GiB over build + steps; plan's estimate {estimate / 2**30:.2f} GiB "
            f"(tables, state, buffers; {peak / estimate:.2f}x)",
            {"peak_bytes": peak, "estimate_bytes": estimate},
        )
    )


def check_speed(report: Report, mode: Mode) -> None:
    bandwidth = copy_bandwidth(mode)
    report.add(
        Check(
            "speed", "device copy bandwidth", Status.INFO, f"{bandwidth:.1f} GB/s (read + write)", {"gbps": bandwidth}
        )
    )
    kernel_throughput(report, mode, bandwidth)
    steps_syncs_memory(report, mode)
