"""The variants of ``e2e_bench.py`` that run this project's code, one function per variant.

Each runs in fresh processes started by ``e2e_bench.py --worker <variant>`` (rank and
world size from the environment) and writes one ``RankResult`` per rank. TorchRec's
variant lives in ``_e2e_torchrec_worker.py`` (its own venv).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _e2e_common import (
    DIM,
    EPS,
    LR,
    RankResult,
    StepTimer,
    feature_names,
    load_batches,
    make_dense_arch,
    offsets_of,
    peak_rss_mib,
    rss_mib,
    table_rows,
    train_timed,
    worker_env,
)


@dataclass
class WorkerArgs:
    variant: str
    batches: Path  # directory with rank<r>.pt
    out: Path
    warmup: int
    steps: int
    shrink: int
    batch_size: int  # per rank
    profile: Path | None


def our_tables(shrink: int) -> list[Any]:
    from lightning_shardrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=DIM, name=f"t{i}", feature_names=[f"f{i}"])
        for i, n in enumerate(table_rows(shrink))
    ]


def rec_batches(path: Path) -> list[Any]:
    """Pre-generated batches as our ``RecBatch`` (built before timing)."""
    from lightning_shardrec import KeyedJaggedTensor, RecBatch

    out = []
    for b in load_batches(path):
        n = b["dense"].shape[0]
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(8)], b["values"], lengths=b["lengths"], stride=n)
        out.append(RecBatch(b["dense"], kjt, b["labels"]))
    return out


def _bench_model(shrink: int):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    from lightning_shardrec import EmbeddingBagCollection

    class BenchModel(nn.Module):
        """Our EBC (built on ``meta``: shards are materialised by the sharder) + the MLPs."""

        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(our_tables(shrink), device="meta")
            self.dense_arch = make_dense_arch()

        def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
            return self.dense_arch(dense, self.ebc(kjt).values())

    return BenchModel()


def plan_summary(plan: Any) -> str:
    kinds: dict[str, list[str]] = {}
    for tables in plan.plan.values():
        for name, ps in tables.items():
            kinds.setdefault(ps.sharding_type.value, []).append(name)
    return "; ".join(f"{k}: {','.join(sorted(v))}" for k, v in sorted(kinds.items()))


def worker_dmp_plain(a: WorkerArgs) -> None:
    import torch
    import torch.distributed as dist

    from lightning_shardrec import DistributedModelParallel, FusedOptimConfig

    import_rss = rss_mib()
    rank, world = worker_env()
    dist.init_process_group("gloo")
    batches = rec_batches(a.batches / f"rank{rank}.pt")
    bsz = batches[0].batch_size
    config = FusedOptimConfig(optimizer="rowwise_adagrad", lr=LR, eps=EPS)
    model = DistributedModelParallel(_bench_model(a.shrink), embedding_optimizer=config, batch_size=bsz)
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=LR)
    steps = [(b.dense, b.sparse, b.labels) for b in batches[: a.warmup + a.steps]]
    seconds, losses, cpu = train_timed(steps, model, opt, a.warmup)
    RankResult(
        a.variant, rank, world, bsz, seconds, import_rss, peak_rss_mib(), losses, plan_summary(model.plan), cpu_ms=cpu
    ).write(a.out)
    dist.destroy_process_group()


def worker_shardrec(a: WorkerArgs) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F

    import lightning_shardrec  # noqa: F401  (registers strategy="shardrec")
    from lightning_shardrec import FusedOptimConfig, ShardRecStrategy

    import_rss = rss_mib()
    worker_env()  # one thread, the common seed
    total = a.warmup + a.steps

    class Batches:
        """An iterable of pre-built batches (Lightning takes any iterable)."""

        def __init__(self, items: list[Any]) -> None:
            self.items = items

        def __iter__(self) -> Iterator[Any]:
            return iter(self.items)

        def __len__(self) -> int:
            return len(self.items)

    class BenchTask(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _bench_model(a.shrink)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.binary_cross_entropy_with_logits(self.model(batch.dense, batch.sparse), batch.labels)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adagrad(self.parameters(), lr=LR)

        def train_dataloader(self) -> Batches:
            return Batches(rec_batches(a.batches / f"rank{self.global_rank}.pt")[:total])

    class StepTiming(L.Callback):
        def __init__(self) -> None:
            self.timer = StepTimer(a.warmup)
            self.losses: list[float] = []
            self.profiler = StepProfiler(a.warmup) if a.profile is not None else None
            if self.profiler is not None:
                _trace_collectives()

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            self.timer.tick()
            if self.profiler is not None and trainer.global_rank == 0:
                self.profiler.tick()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            self.losses.append(float(outputs["loss"]))
            if i == total - 1:
                self.timer.tick()
                self.timer.finish()
                if self.profiler is not None and trainer.global_rank == 0:
                    self.profiler.tick(last=True)

        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            strategy = trainer.strategy
            RankResult(
                a.variant,
                trainer.global_rank,
                trainer.world_size,
                int(pl_module.trainer.train_dataloader.items[0].batch_size),
                self.timer.seconds,
                import_rss,
                peak_rss_mib(),
                self.losses,
                plan_summary(strategy.plan),
                cpu_ms=self.timer.cpu_ms,
            ).write(a.out)
            if self.profiler is not None and trainer.global_rank == 0:
                self.profiler.write(a.profile, self.timer.seconds)

    strategy = ShardRecStrategy(
        embedding_optimizer=FusedOptimConfig(optimizer="rowwise_adagrad", lr=LR, eps=EPS),
        planner_batch_size=a.batch_size,
        pipeline=a.variant in ("shardrec_pipeline", "shardrec_pg_pipeline"),
        comm_precision="bf16" if a.variant == "shardrec_bf16" else "fp32",
        comm_transport="pg" if a.variant in ("shardrec_pg", "shardrec_pg_pipeline") else "auto",
    )
    timing = StepTiming()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timing],
    )
    trainer.fit(BenchTask())


class StepProfiler:
    """torch.profiler around each timed step separately; keeps every step's top-level
    breakdown and the full op table of the slowest and of the median step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._n = 0
        self._prof: Any = None
        self._t0 = 0.0
        self.steps: list[dict[str, Any]] = []

    def tick(self, last: bool = False) -> None:
        import torch.profiler as tp

        if self._prof is not None:
            wall_ms = (time.perf_counter() - self._t0) * 1e3  # the profiled step alone, not this bookkeeping
            self._prof.stop()
            self.steps.append({"wall_ms": wall_ms, **self._summarise(self._prof)})
            self._prof = None
        self._n += 1
        if self._n > self.warmup and not last:
            self._prof = tp.profile(activities=[tp.ProfilerActivity.CPU])
            self._prof.start()
            self._t0 = time.perf_counter()

    @staticmethod
    def _summarise(prof: Any) -> dict[str, Any]:
        top: dict[str, float] = {}
        for e in prof.events():  # self times partition the profiled time
            key = _category(e.name)
            parent = e.cpu_parent  # an op inside a kernel or a collective counts as that
            while parent is not None and key not in (KERNELS, COLLECTIVES):
                key = _SCOPES.get(parent.name, key)
                parent = parent.cpu_parent
            top[key] = top.get(key, 0.0) + e.self_cpu_time_total / 1e3
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
        return {"top_ms": top, "table": table}

    def write(self, path: Path, seconds: list[float]) -> None:
        walls = [s["wall_ms"] for s in self.steps]
        order = sorted(range(len(walls)), key=lambda i: walls[i])
        picks = {"slowest": order[-1], "median": order[len(order) // 2]}
        out: dict[str, Any] = {name: {"index": i, **self.steps[i]} for name, i in picks.items()}
        out["all_wall_ms"] = walls
        path.write_text(json.dumps(out))


KERNELS = "embedding kernels (lookup, backward + row-wise adagrad; torch backend or fbgemm TBE)"
COLLECTIVES = "collectives (all-to-all / all-reduce / broadcast, shared memory or gloo, incl. waiting for the peer)"
# Scopes whose every nested op (and own self time) belongs to one kind: the torch kernel's
# autograd Function, fbgemm's, and the collective calls and waits ``_trace_collectives`` marks.
_SCOPES = {
    "_FusedLookup": KERNELS,
    "_FusedLookupBackward": KERNELS,
    "_PooledAllToAll": COLLECTIVES,
    "_PooledAllToAllBackward": COLLECTIVES,
    "shardrec_bench::collective": COLLECTIVES,
}


def _trace_collectives() -> None:
    """Mark every blocking collective call and ``Work.wait()`` (gloo's and the same-host transport's) as a
    profiler scope (profiled rank only), so the time spent waiting inside them is not counted as the caller's Python."""
    import functools

    import torch
    import torch.distributed as dist

    def traced(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function("shardrec_bench::collective"):
                return fn(*args, **kwargs)

        return call

    from lightning_shardrec.distributed.transport.shm import ShmTransport, ShmWork

    for name in ("all_to_all_single", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"):
        setattr(dist, name, traced(getattr(dist, name)))
    dist.Work.wait = traced(dist.Work.wait)  # type: ignore[method-assign]
    ShmTransport.all_to_all = traced(ShmTransport.all_to_all)  # type: ignore[method-assign]  # same-host transport
    ShmWork.wait = traced(ShmWork.wait)  # type: ignore[method-assign]


def _category(name: str) -> str:
    """Group ops by their *self* time into what a reader can act on."""
    if name in _SCOPES:
        return _SCOPES[name]
    if name.startswith("fbgemm::") or name.startswith("SplitLookupFunction"):
        return KERNELS
    if name.startswith(("c10d::", "gloo:", "record_param_comms")) or "AllToAll" in name or "all_to_all" in name:
        return COLLECTIVES
    if name in ("aten::sqrt", "aten::addcmul_", "aten::addcdiv_", "aten::div", "aten::add_") or "_foreach" in name:
        return "element-wise math (mostly dense Adagrad: sqrt, addcmul_, addcdiv_)"
    if name in ("aten::mm", "aten::addmm", "aten::relu", "aten::threshold_backward", "aten::cat", "aten::sum"):
        return "MLP math (mm, addmm, relu, cat)"
    if name.startswith(("aten::", "prim::")):
        return "other aten ops (copies, index, cumsum, allocations, ...)"
    return "Python inside profiled scopes (DDP.forward, Optimizer.step, autograd nodes, ...)"


def worker_ddp_sparse(a: WorkerArgs) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import_rss = rss_mib()
    rank, world = worker_env()
    dist.init_process_group("gloo")
    raw = load_batches(a.batches / f"rank{rank}.pt")[: a.warmup + a.steps]
    batches = []
    for b in raw:  # per-feature (values, offsets), built before timing
        n = b["dense"].shape[0]
        lengths = b["lengths"].view(8, n)
        per_key = b["values"].split(lengths.sum(1).tolist())
        feats = [(v, offsets_of(ln)[:-1]) for v, ln in zip(per_key, lengths, strict=True)]
        batches.append((b["dense"], feats, b["labels"]))

    class SparseModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.bags = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in table_rows(a.shrink))
            for bag in self.bags:
                nn.init.uniform_(bag.weight, -(bag.num_embeddings**-0.5), bag.num_embeddings**-0.5)
            self.dense_arch = make_dense_arch()

        def forward(self, dense: torch.Tensor, feats: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
            pooled = torch.cat([bag(v, o) for bag, (v, o) in zip(self.bags, feats, strict=True)], 1)
            return self.dense_arch(dense, pooled)

    model = DistributedDataParallel(SparseModel())
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    seconds, losses, cpu = train_timed(batches, model, opt, a.warmup)
    RankResult(
        a.variant, rank, world, int(batches[0][0].shape[0]), seconds, import_rss, peak_rss_mib(), losses,
        "data_parallel: all (full tables on every rank)", cpu_ms=cpu,
    ).write(a.out)
    dist.destroy_process_group()


def worker_kernel_floor(a: WorkerArgs) -> None:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

    import_rss = rss_mib()
    worker_env()
    raw = load_batches(a.batches / "rank0.pt")[: a.warmup + a.steps]
    batches = [(b["dense"], b["values"], offsets_of(b["lengths"]), b["labels"]) for b in raw]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in table_rows(a.shrink)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE,
        device=torch.device("cpu"),
    )
    arch = make_dense_arch()
    opt = torch.optim.Adagrad(arch.parameters(), lr=LR)
    seconds, losses, cpu = train_timed(batches, lambda dense, v, o: arch(dense, tbe(v, o)), opt, a.warmup)
    RankResult(
        a.variant, 0, 1, int(batches[0][0].shape[0]), seconds, import_rss, peak_rss_mib(), losses,
        "one TBE, all 8 tables", cpu_ms=cpu,
    ).write(a.out)


def worker_kernel_floor_torch(a: WorkerArgs) -> None:
    """The floor on our own kernel: the portable torch kernel (what ``kernel="auto"`` runs for
    row-wise Adagrad on CPU) with all 8 tables, plus the MLPs, one process, no framework."""
    import torch

    from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
    from lightning_shardrec.kernels import TableSpec, make_kernel

    import_rss = rss_mib()
    worker_env()
    raw = load_batches(a.batches / "rank0.pt")[: a.warmup + a.steps]
    keys = feature_names()
    batches = [
        (b["dense"], KeyedJaggedTensor(keys, b["values"], lengths=b["lengths"], stride=len(b["dense"])), b["labels"])
        for b in raw
    ]
    specs = [TableSpec(name=f"t{i}", num_embeddings=n, embedding_dim=DIM) for i, n in enumerate(table_rows(a.shrink))]
    optim = FusedOptimConfig(optimizer="rowwise_adagrad", lr=LR, eps=EPS)
    kernel = make_kernel(specs, list(range(len(specs))), optim, pooled=True, device="cpu", kernel="torch")
    with torch.no_grad():
        for w in kernel.split_weights():
            w.uniform_(-0.01, 0.01)
    arch = make_dense_arch()
    opt = torch.optim.Adagrad(arch.parameters(), lr=LR)
    seconds, losses, cpu = train_timed(batches, lambda dense, kjt: arch(dense, kernel(kjt)), opt, a.warmup)
    RankResult(
        a.variant, 0, 1, int(batches[0][0].shape[0]), seconds, import_rss, peak_rss_mib(), losses,
        "torch kernel, all 8 tables", cpu_ms=cpu,
    ).write(a.out)


WORKERS = {
    "shardrec": worker_shardrec,
    "shardrec_pipeline": worker_shardrec,
    "shardrec_bf16": worker_shardrec,
    "shardrec_pg": worker_shardrec,
    "shardrec_pg_pipeline": worker_shardrec,
    "dmp_plain": worker_dmp_plain,
    "ddp_sparse": worker_ddp_sparse,
    "kernel_floor": worker_kernel_floor,
    "kernel_floor_torch": worker_kernel_floor_torch,
}
