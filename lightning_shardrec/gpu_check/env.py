"""Where the check runs: the mode and its sizes, a one-rank process group, timing, the GPU's code path on CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Workload sizes of one mode (CUDA: a real GPU's worth; CPU: tiny, so CI runs it in seconds)."""

    exact_steps: int = 3  # the exactness runs (tiny in both modes: every row touched every step)
    exact_batch: int = 32
    copy_mib: int = 1024  # the bandwidth reference copy
    kernel_rows: int = 1_000_000  # per table, 4 tables, for the kernel's throughput
    kernel_dim: int = 128
    kernel_batch: int = 8192
    kernel_pooling: int = 20
    step_tables: int = 8  # the DLRM step (Lightning vs a plain loop, dynamic vs static)
    step_rows: int = 500_000
    step_dim: int = 64
    step_batch: int = 4096
    steps: int = 30  # timed steps (after ``warmup``)
    warmup: int = 5


CUDA_SIZES = Sizes()
CPU_SIZES = Sizes(
    copy_mib=32,
    kernel_rows=4000,
    kernel_dim=16,
    kernel_batch=256,
    kernel_pooling=4,
    step_tables=3,
    step_rows=2000,
    step_dim=16,
    step_batch=128,
    steps=4,
    warmup=1,
)


@dataclass(frozen=True)
class Mode:
    """``device`` and ``sizes`` of this run; ``cuda``: whether it is the GPU mode."""

    device: torch.device
    sizes: Sizes

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @staticmethod
    def detect(force_cpu: bool = False) -> Mode:
        if torch.cuda.is_available() and not force_cpu:
            return Mode(torch.device("cuda", torch.cuda.current_device()), CUDA_SIZES)
        return Mode(torch.device("cpu"), CPU_SIZES)

    def describe(self) -> str:
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            return f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"
        return "CPU (no GPU visible: tiny sizes, the GPU's code paths run as on a GPU where they can)"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@contextmanager
def one_rank_group(mode: Mode) -> Iterator[None]:
    """A process group of this process alone (NCCL for CUDA tensors beside gloo), destroyed after."""
    if dist.is_initialized():
        yield
        return
    backend = "cpu:gloo,cuda:nccl" if mode.cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def median_seconds(step: Callable[[], object], mode: Mode, steps: int, warmup: int) -> float:
    """Median wall seconds of ``step()`` over ``steps`` calls after ``warmup`` (device synced around each)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        mode.sync()
        t0 = time.perf_counter()
        step()
        mode.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def gpu_code_path() -> Iterator[bool]:
    """On CPU, run the GPU's code paths: the dynamic tables' tensor ops instead of the compiled loops,
    the ids' range check on the device (a flag read with the batch header) instead of on the host, and
    key permutes by one operator instead of key by key on the host.

    Yields whether it could (False if the loops are no longer found where this expects them).
    """
    from lightning_shardrec.modules import features, table_init
    from lightning_shardrec.modules.dynamic import slots
    from lightning_shardrec.sparse import ops

    if not all(hasattr(m, "native_loops") for m in (slots, table_init)) or not hasattr(ops, "_slices_for"):
        yield False
        return
    saved = slots.native_loops, table_init.native_loops, features.checks_on_device, ops._slices_for
    slots.native_loops = table_init.native_loops = lambda: None  # type: ignore[assignment]
    features.checks_on_device = lambda device: True  # type: ignore[assignment]
    ops._slices_for = lambda *tensors: False  # type: ignore[assignment]
    try:
        yield True
    finally:
        slots.native_loops, table_init.native_loops, features.checks_on_device, ops._slices_for = saved
