"""Pieces every ``e2e_bench.py`` variant shares; imports only torch and the stdlib.

The TorchRec worker (``_e2e_torchrec_worker.py``) runs in ``benchmarks/.venv-torchrec``,
where ``lightning_shardrec`` is not installed, so the model's dense part, the batch
file format, the step timer and the memory probes live here, free of the library.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

NUM_DENSE = 13
DIM = 64
NUM_TABLES = 8
LR = 0.05  # tables (row-wise Adagrad) and dense layers (Adagrad)
EPS = 1e-8
TABLE_ROWS = [200_000] * 4 + [20_000] * 4  # t0..t3, t4..t7; feature f<i> -> table t<i>


def table_rows(shrink: int = 1) -> list[int]:
    return [max(1, n // shrink) for n in TABLE_ROWS]


def feature_names() -> list[str]:
    return [f"f{i}" for i in range(NUM_TABLES)]


class DenseArch(nn.Module):
    """Bottom MLP 13 -> 128 -> 64, concat(dense out, 8 pooled) = 576, top 576 -> 256 -> 1."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(NUM_DENSE, 128), nn.ReLU(), nn.Linear(128, DIM), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM * (NUM_TABLES + 1), 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """``dense [B, 13]``, ``pooled [B, 8 * 64]`` (tables in order) -> logits ``[B]``."""
        return self.top(torch.cat([self.bottom(dense), pooled], dim=1)).squeeze(1)


def make_dense_arch(seed: int = 0) -> DenseArch:
    """The same initial MLP weights in every variant."""
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    arch = DenseArch()
    torch.random.set_rng_state(g)
    return arch


# --- batch files ------------------------------------------------------------------------------
# One file per rank: a list of dicts of plain tensors, so both venvs read it.
#   dense [B, 13] f32, labels [B] f32, values [N] i64, lengths [8 * B] i64 (feature-major).


def load_batches(path: str | os.PathLike[str]) -> list[dict[str, Tensor]]:
    return torch.load(path, weights_only=True)


def offsets_of(lengths: Tensor) -> Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


# --- timing and memory ------------------------------------------------------------------------


def rss_mib() -> float:
    """Current resident set of this process (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    """Peak resident set of this process so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def thread_cpu_ms() -> dict[str, float]:
    """On-CPU milliseconds so far of this process's threads: ``main`` and the others summed
    (gloo's, Lightning's...), from ``/proc/self/task/*/schedstat``; empty where there is none.
    A thread that ends between two readings drops out of the second (gloo's live for the run)."""
    out = {"main": 0.0, "other threads": 0.0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    main = str(os.getpid())
    for tid in tids:
        try:
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended
        out["main" if tid == main else "other threads"] += ns / 1e6
    return out


class StepTimer:
    """Start-to-start times of loop iterations: everything a step costs, data fetch included.

    ``tick()`` at the start of every step and once after the last, then ``finish()``; the
    first ``warmup`` intervals are dropped. ``cpu_ms``: CPU per timed step of the main
    thread and of the others (the process's threads read at the first timed tick and at
    ``finish()``: waiting costs no CPU, so other jobs move it less than the wall time).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._last: float | None = None
        self._count = 0
        self._ticks = 0
        self._cpu0: dict[str, float] = {}
        self.seconds: list[float] = []
        self.cpu_ms: dict[str, float] = {}

    def tick(self) -> None:
        if self._ticks == self.warmup:
            self._cpu0 = thread_cpu_ms()
        self._ticks += 1
        now = time.perf_counter()
        if self._last is not None:
            if self._count >= self.warmup:
                self.seconds.append(now - self._last)
            self._count += 1
        self._last = now

    def finish(self) -> None:
        """After the last ``tick()``: CPU per timed step since the first timed tick."""
        end, steps = thread_cpu_ms(), len(self.seconds)
        if self._cpu0 and end and steps:
            self.cpu_ms = {k: (end[k] - self._cpu0.get(k, 0.0)) / steps for k in end}


def train_timed(
    batches: list[tuple[Any, ...]], forward: Any, opt: Any, warmup: int
) -> tuple[list[float], list[float], dict[str, float]]:
    """The plain loop every non-Lightning variant times: ``(*inputs, labels)`` per batch,
    BCE-with-logits of ``forward(*inputs)``, backward, ``opt`` step.

    Returns ``(step seconds after warmup, losses, CPU ms per timed step by thread)``.
    """
    import torch.nn.functional as F

    timer, losses = StepTimer(warmup), []
    for *inputs, labels in batches:
        timer.tick()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(forward(*inputs), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    timer.tick()
    timer.finish()
    return timer.seconds, losses, timer.cpu_ms


@dataclass
class RankResult:
    variant: str
    rank: int
    world_size: int
    batch_size: int  # per rank
    step_seconds: list[float]
    import_rss_mib: float
    peak_rss_mib: float
    losses: list[float] = field(default_factory=list)
    plan: str = ""
    note: str = ""
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per timed step: main thread, other threads

    def write(self, out_dir: str | os.PathLike[str]) -> None:
        path = Path(out_dir) / f"{self.variant}.rank{self.rank}.json"
        path.write_text(json.dumps(asdict(self)))


def read_result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


#: the global seed of every worker (table seeds are drawn from torch's global generator)
SEED = 0


def worker_env() -> tuple[int, int]:
    """``(rank, world_size)`` of a worker the orchestrator started; one thread per rank; torch's global
    generator seeded (:data:`SEED`; torch seeds it randomly at start otherwise), so every variant of ours
    starts from the same tables and their losses compare step by step."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
