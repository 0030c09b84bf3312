"""The multi-GPU mode: one process per GPU on NCCL, run when 2+ CUDA devices are visible.

Each rank (:func:`rank_checks`, started by :func:`~lightning_shardrec.testing.run_ranks` on the
``cpu:gloo,cuda:nccl`` backend, ``cuda:<rank>``) runs:

- **exactness**: a probe (two tables, one row-wise, one table-wise, a fixed projection) trained
  for a few steps through :class:`~lightning_shardrec.DistributedModelParallel` on every rank,
  each rank fed its slice of the same global batches, against one process training the unsharded
  collection with ``torch.optim.Adagrad`` on the whole batch: every step's outputs of the rank's
  rows, with the torch kernel and, when fbgemm's ops run on the device, with fbgemm's;
- **host syncs per step**: one training step of the sharded DLRM counted on every rank (CUDA's
  sync debug mode; on CPU the aten ops that would sync on CUDA, forward and backward);
- **step time**: the median step of that DLRM (the planner's plan over the ranks), per rank;
- **all-to-all bandwidth**: ``all_to_all_single`` of ``a2a_mib`` per rank, the bytes each rank
  sends to the others per second.

The same code runs on CPU ranks with gloo when :data:`TEST_ENV` is set (``device="cpu"``, the
tiny sizes): that is how CPU CI proves the mode runs; the CUDA path runs where GPUs are lent.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_shardrec import DistributedModelParallel, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec import _fbgemm as fbgemm
from lightning_shardrec.data.datamodule import SyntheticRecDataModule
from lightning_shardrec.gpu_check.collections import TOL, TORCH_TWINS, Probe
from lightning_shardrec.gpu_check.env import CPU_SIZES, CUDA_SIZES, Sizes, gpu_code_path
from lightning_shardrec.gpu_check.report import Check, Report, Status
from lightning_shardrec.gpu_check.syncs import SyncCount, SyncOps, cuda_syncs
from lightning_shardrec.gpu_check.trainer import NUM_DENSE, StepModule, tables
from lightning_shardrec.planner import (
    ComputeDevice,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingType,
    Topology,
)

#: set to a rank count (e.g. ``2``): the multi-GPU mode's code on that many CPU ranks with gloo (tests)
TEST_ENV = "LIGHTNING_SHARDREC_GPU_CHECK_MULTI_CPU"
EXACT_ROWS, EXACT_DIMS, POOLING = 24, (8, 16), 3
KINDS = {"t0": ShardingType.ROW_WISE, "t1": ShardingType.TABLE_WISE}


@dataclass(frozen=True)
class MultiMode:
    """``world`` ranks of ``device_type`` on ``backend``, with ``sizes`` (per rank) and ``a2a_mib``."""

    world: int
    device_type: str
    backend: str
    sizes: Sizes
    a2a_mib: int

    @staticmethod
    def detect() -> MultiMode | None:
        """2+ CUDA devices: every one on NCCL; else, with :data:`TEST_ENV` set, CPU ranks on gloo; else None."""
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            return MultiMode(torch.cuda.device_count(), "cuda", "cpu:gloo,cuda:nccl", CUDA_SIZES, 64)
        ranks = os.environ.get(TEST_ENV, "")
        if not ranks:
            return None
        if not ranks.isdigit() or int(ranks) < 2:
            raise ValueError(f"{TEST_ENV} must be a number of CPU ranks >= 2, got {ranks!r}")
        return MultiMode(int(ranks), "cpu", "gloo", replace(CPU_SIZES, steps=3, warmup=1), 1)

    def describe(self) -> str:
        if self.device_type == "cuda":
            return f"{self.world} x {torch.cuda.get_device_name(0)} on NCCL"
        return f"{self.world} CPU ranks on gloo ({TEST_ENV}: the CUDA mode's code on CPU)"


def _device(mode: MultiMode, rank: int) -> torch.device:
    if mode.device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ids(g: torch.Generator, bags: int) -> Tensor:
    """``bags * POOLING`` ids; every row among them when there are enough (every row trained every step)."""
    n = bags * POOLING
    every = torch.arange(min(n, EXACT_ROWS))
    ids = torch.cat([every, torch.randint(0, EXACT_ROWS, (n - every.numel(),), generator=g)])
    return ids[torch.randperm(n, generator=g)]


def exact_batches(world: int, bags: int, steps: int) -> list[tuple[KeyedJaggedTensor, list[KeyedJaggedTensor]]]:
    """Per step: the global KJT (rank 0's bags first, then rank 1's, ...) and each rank's slice of it."""
    g = torch.Generator().manual_seed(3)
    features = [f"f{i}" for i in range(len(EXACT_DIMS))]
    out = []
    for _ in range(steps):
        ids = [[_ids(g, bags) for _ in features] for _ in range(world)]  # [rank][feature]
        lengths = torch.full((len(features) * bags,), POOLING)
        per_rank = [KeyedJaggedTensor(features, torch.cat(ids[r]), lengths=lengths) for r in range(world)]
        values = torch.cat([ids[r][f] for f in range(len(features)) for r in range(world)])
        out.append((KeyedJaggedTensor(features, values, lengths=lengths.repeat(world)), per_rank))
    return out


def _probe() -> Probe:
    torch.manual_seed(0)
    specs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=EXACT_ROWS, feature_names=[f"f{i}"])
        for i, d in enumerate(EXACT_DIMS)
    ]
    return Probe(EmbeddingBagCollection(specs), sum(EXACT_DIMS))


def _planner(mode: MultiMode, batch: int, kinds: dict[str, ShardingType]) -> EmbeddingShardingPlanner:
    topology = Topology(mode.world, compute_device=ComputeDevice(mode.device_type))
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
    return EmbeddingShardingPlanner(topology, batch_size=batch, constraints=constraints)


def exactness(mode: MultiMode, rank: int, device: torch.device, kernel: str) -> tuple[float, bool]:
    """Max |diff| of this rank's outputs (every step, then an eval) against one process on the global
    batches, and whether every output is within :data:`~lightning_shardrec.gpu_check.collections.TOL`."""
    from lightning_shardrec.configs import EmbOptimType
    from lightning_shardrec.lightning.parameters.optimizers import derive_fused_config

    bags = mode.sizes.exact_batch
    data = exact_batches(mode.world, bags, mode.sizes.exact_steps)
    plain = _probe().to(device)
    opt = TORCH_TWINS[EmbOptimType.ADAGRAD](plain.parameters())
    fused = derive_fused_config(opt, opt.param_groups[0])
    dmp = DistributedModelParallel(
        _probe(), device=device, embedding_optimizer=fused, kernel=kernel, planner=_planner(mode, bags, KINDS)
    )
    mine = slice(rank * bags, (rank + 1) * bags)
    pairs = []
    for whole, parts in data:
        want = plain(whole.to(device))  # the mean over the global batch = the ranks' means averaged
        (want**2).mean().backward()
        opt.step()
        opt.zero_grad()
        got = dmp(parts[rank].to(device))
        (got**2).mean().backward()
        pairs.append((got.detach().float().cpu(), want[mine].detach().float().cpu()))
    with torch.no_grad():
        pairs.append((dmp(data[0][1][rank].to(device)).float().cpu(), plain(data[0][0].to(device))[mine].float().cpu()))
    worst = max(float((g - w).abs().max()) for g, w in pairs)
    return worst, all(torch.allclose(g, w, **TOL) for g, w in pairs)


def _step_batches(mode: MultiMode, rank: int, specs: list[EmbeddingBagConfig], device: torch.device) -> list[Any]:
    s = mode.sizes
    feats = [{"name": t.feature_names[0], "num_embeddings": t.num_embeddings} for t in specs]
    dm = SyntheticRecDataModule(
        num_dense=NUM_DENSE, tables=feats, batch_size=s.step_batch, num_batches=s.warmup + s.steps + 1,
        val_batches=0, seed=1 + rank,
    )  # fmt: skip
    dm.setup("fit")
    return [b.to(device) for b in dm.train_dataloader()]


def step_figures(mode: MultiMode, device: torch.device, rank: int) -> dict[str, Any]:
    """The DLRM's median step (seconds) and one step's host syncs on this rank."""
    s = mode.sizes
    specs = tables(s.step_tables, s.step_rows, s.step_dim)
    module = StepModule(specs)
    planner = EmbeddingShardingPlanner(
        Topology(mode.world, compute_device=ComputeDevice(mode.device_type)), batch_size=s.step_batch
    )
    dmp = DistributedModelParallel(module, device=device, planner=planner, embedding_optimizer="adagrad")
    opt = torch.optim.Adagrad(dmp.dense_parameters(), lr=module.lr, eps=1e-8)
    batches = _step_batches(mode, rank, specs, device)

    def step(batch: Any) -> None:
        F.binary_cross_entropy_with_logits(dmp(batch), batch.labels).backward()
        opt.step()
        opt.zero_grad()

    times = []
    for i, batch in enumerate(batches[:-1]):
        _sync(device)
        t0 = time.perf_counter()
        step(batch)
        _sync(device)
        if i >= s.warmup:
            times.append(time.perf_counter() - t0)
    count = _count(device, step, batches[-1])
    return {"step_s": statistics.median(times), "syncs": count.total, "sites": dict(count.sites.most_common(8))}


def _count(device: torch.device, step: Any, batch: Any) -> SyncCount:
    if device.type == "cuda":
        with cuda_syncs() as count:
            step(batch)
        return count
    with gpu_code_path(), SyncOps() as count:  # the GPU's code path, every aten op that would sync there
        step(batch)
    return count


def all_to_all_gbps(mode: MultiMode, device: torch.device) -> float:
    """GB/s this rank sends to the others through ``all_to_all_single`` (median of 5 after 2)."""
    n = mode.a2a_mib * 2**20 // 4 // mode.world * mode.world
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    times = []
    for i in range(7):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(dst, src)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    sent = n * 4 * (mode.world - 1) / mode.world
    return sent / statistics.median(times) / 1e9


def rank_checks(rank: int, world: int, mode: MultiMode) -> dict[str, Any]:
    """Every multi-rank figure of this rank (called on every rank by :func:`check_multi`)."""
    device = _device(mode, rank)
    kernels = ["torch"] + (["fbgemm"] if fbgemm.fbgemm_ops_on(device.type) else [])
    out: dict[str, Any] = {"exact": {k: exactness(mode, rank, device, k) for k in kernels}}
    out.update(step_figures(mode, device, rank))
    out["a2a_gbps"] = all_to_all_gbps(mode, device)
    return out


def check_multi(report: Report, mode: MultiMode) -> None:
    """The multi-rank checks (see the module docstring), one line each, figures per rank."""
    from lightning_shardrec.testing import close_pools, run_ranks

    try:
        ranks = run_ranks(rank_checks, mode.world, mode, backend=mode.backend, timeout=1200.0)
    finally:
        close_pools()
    where = f"{mode.world} ranks ({mode.device_type}, {mode.backend})"
    for kernel in ranks[0]["exact"]:
        diffs = [r["exact"][kernel][0] for r in ranks]
        ok = all(r["exact"][kernel][1] for r in ranks)
        report.add(
            Check(
                "multi-rank",
                f"{where}: {kernel} kernel vs one process",
                Status.PASS if ok else Status.FAIL,
                f"max |diff| {max(diffs):.2e} over every step's outputs of every rank "
                f"(row-wise + table-wise tables, Adagrad; tolerance rtol {TOL['rtol']}, atol {TOL['atol']})",
                {"max_abs_diff_per_rank": diffs},
            )
        )
    syncs = [r["syncs"] for r in ranks]
    how = "CUDA's sync debug mode" if mode.device_type == "cuda" else "aten ops that sync on CUDA"
    report.add(
        Check(
            "multi-rank",
            f"{where}: host syncs per DLRM step",
            Status.INFO,
            f"{min(syncs)}-{max(syncs)} per rank ({how}); rank 0: "
            + (", ".join(f"{k} x{n}" for k, n in ranks[0]["sites"].items()) or "none"),
            {"per_rank": syncs, "sites_rank0": ranks[0]["sites"]},
        )
    )
    steps = [r["step_s"] for r in ranks]
    s = mode.sizes
    report.add(
        Check(
            "multi-rank",
            f"{where}: DLRM step time",
            Status.INFO,
            f"median {max(steps) * 1e3:.2f} ms (slowest rank); {s.step_tables} tables of {s.step_rows} rows x "
            f"{s.step_dim}, batch {s.step_batch} per rank, the planner's plan",
            {"step_s_per_rank": steps},
        )
    )
    gbps = [r["a2a_gbps"] for r in ranks]
    report.add(
        Check(
            "multi-rank",
            f"{where}: all-to-all bandwidth",
            Status.INFO,
            f"{min(gbps):.2f}-{max(gbps):.2f} GB/s sent per rank ({mode.a2a_mib} MiB per rank per all_to_all_single)",
            {"gbps_per_rank": gbps},
        )
    )
