"""``kernel="auto"``: time every backend that can run a group here, keep the faster, remember it.

Which kernel is faster depends on the machine and on whether the torch kernel's compiled
loops are built (fbgemm's CPU TBE trained row-wise Adagrad 2x faster than the torch kernel's
tensor ops on an AMD EPYC, 1.8x slower on an Intel Xeon; the loops train it 1.3x faster than
fbgemm on an AMD EPYC), so ``auto`` measures instead of assuming. For one group of tables it
builds each candidate backend on synthetic tables of the group's dims (rows capped at
:data:`ROW_CAP`) and times forward, backward and the fused update on a batch shaped like the
planner's inputs
(:class:`Workload`: batch size, ids per bag, power-law ids), a few repetitions, and keeps
the fastest. The backends take turns (A B A B ...) and each keeps its fastest step: on a
shared machine other jobs only ever add time, so the minimum is the kernel's own cost and
a burst of load cannot hand the verdict to the slower kernel. A measurement whose two
fastest steps of a backend still differ by more than :data:`STEADY` is used but not cached
(the next run times again). The synthetic kernels never touch the real one, and the RNG
state is restored, so the choice cannot change results beyond which (exact) kernel runs.

The verdict is cached per machine and configuration (:func:`cache_key`) in
``$LIGHTNING_SHARDREC_KERNEL_CACHE`` (a directory; ``off`` disables the cache), else
``$XDG_CACHE_HOME/lightning_shardrec`` (else ``~/.cache/lightning_shardrec``), so later
runs skip the timing. ``LIGHTNING_SHARDREC_KERNEL=fbgemm|torch`` pins every ``auto``.

Ids per bag decide the verdict too: on an AMD EPYC with AVX-512 fbgemm's TBE was 1.1x the torch kernel at 1
id per bag and 1.8x at 8. Where the planner's constraints give no pooling factors, a table's pooling is not
known when the kernel is built, so each backend is timed at :data:`UNDECLARED_POOLINGS` and scored by the
geometric mean: the verdict that is best across the range rather than at an assumed 1.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from lightning_shardrec._fbgemm import installed_build
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.kernels import native
from lightning_shardrec.kernels.base import BatchedEmbeddingKernel, KernelBackend, TableSpec
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.user_cache import user_cache_dir

CACHE_ENV = "LIGHTNING_SHARDREC_KERNEL_CACHE"
PIN_ENV = "LIGHTNING_SHARDREC_KERNEL"
ROW_CAP = 1 << 15  # synthetic rows per table: the timing's memory and init stay small
ID_CAP = 1 << 16  # ids per synthetic batch (fewer bags when the planner's batch has more)
REPS = 5  # timed steps per backend at most (after one warm-up step each)
MIN_REPS = 3  # timed steps per backend at least, whatever the budget
BUDGET_S = 0.1  # per backend: no timed step beyond MIN_REPS once its steps took this long
STEADY = 1.25  # a backend's two fastest steps within this ratio: the verdict may be cached
#: the timing method, first in every cache key (v1 kept the median of a budget that one slow step
#: could end: a burst of load on a shared machine cached the 2x slower kernel for good)
TIMING = "timing v2"
#: ids per bag timed where a group's pooling is not declared (``Workload.pooling=None``)
UNDECLARED_POOLINGS = (1.0, 4.0, 16.0)

#: seconds of one forward + backward + update step per backend value
Timings = dict[str, float]


class Measurement(dict[str, float]):
    """:data:`Timings` from :func:`measure`; ``steady`` is False when a backend's fastest steps disagree."""

    steady: bool = True


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The batch the timing runs: ``batch_size`` bags per feature, ``pooling`` mean ids per bag (None: not
    declared, timed at each of :data:`UNDECLARED_POOLINGS`)."""

    batch_size: int = 512
    pooling: float | None = 1.0


@dataclass(frozen=True, kw_only=True)
class KernelChoice:
    """The backend one group runs, and why: ``source`` is pinned, only, measured or cached."""

    backend: KernelBackend
    source: str
    seconds: Timings = field(default_factory=dict)
    note: str = ""  # why the other backends could not run

    def label(self) -> str:
        """For the plan printout: ``fbgemm (1.9x torch)``, ``torch (pinned)``, ``torch (only: ...)``."""
        name = self.backend.value
        if self.source in ("measured", "cached") and len(self.seconds) > 1:
            mine = self.seconds[name]
            others = ", ".join(f"{mine and t / mine:.1f}x {b}" for b, t in sorted(self.seconds.items()) if b != name)
            return f"{name} ({others}{', cached' if self.source == 'cached' else ''})"
        if self.source == "only" and self.note:
            return f"{name} (only: {self.note})"
        return f"{name} ({self.source})"


def pinned_backend(kernel: KernelBackend) -> KernelBackend:
    """``kernel``, or for ``auto`` the backend ``$LIGHTNING_SHARDREC_KERNEL`` pins (``auto`` if unset)."""
    from lightning_shardrec.kernels import parse_backend

    if kernel is not KernelBackend.AUTO:
        return kernel
    return parse_backend(os.environ.get(PIN_ENV) or "auto")


# --- timing ---------------------------------------------------------------------------------
def synthetic_batch(
    num_features: int, feature_rows: list[int], workload: Workload, device: torch.device, seed: int = 0
) -> KeyedJaggedTensor:
    """``batch_size`` bags per feature (at most ``ID_CAP`` ids in all) of ~``pooling`` ids (0..2x),
    ids skewed to low rows (power law)."""
    gen = torch.Generator().manual_seed(seed)
    pf = 1.0 if workload.pooling is None else workload.pooling
    b = max(1, min(workload.batch_size, int(ID_CAP / max(pf, 1.0) / num_features)))
    lengths = torch.randint(0, max(1, round(2 * pf)) + 1, (num_features * b,), generator=gen)
    values = []
    for f, n in enumerate(lengths.view(num_features, b).sum(1).tolist()):
        u = torch.rand(n, generator=gen)
        values.append((u.pow(3) * feature_rows[f]).long().clamp_(max=feature_rows[f] - 1))
    keys = [f"f{i}" for i in range(num_features)]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values).to(device), lengths=lengths.to(device))


def time_backends(
    classes: Mapping[str, type[BatchedEmbeddingKernel]],
    tables: list[TableSpec],
    feature_table: list[int],
    optim: FusedOptimConfig,
    *,
    pooled: bool,
    device: torch.device,
    kjt: KeyedJaggedTensor,
) -> dict[str, list[float]]:
    """Seconds of each timed forward + backward (fused update) step per backend, the backends taking turns.

    One warm-up step each, then rounds of one step per backend: at least :data:`MIN_REPS`,
    at most :data:`REPS`, fewer than that once every backend's steps took :data:`BUDGET_S`.
    """
    kernels = {name: cls(tables, feature_table, optim, pooled=pooled, device=device) for name, cls in classes.items()}
    grads: dict[str, torch.Tensor] = {}
    for kernel in kernels.values():
        for w in kernel.split_weights():
            with torch.no_grad():
                w.fill_(0.01)
    times: dict[str, list[float]] = {name: [] for name in kernels}

    def step(name: str) -> float:
        kernel = kernels[name]
        _sync(device)
        start = time.perf_counter()
        out = kernel(kjt)
        if name not in grads:
            grads[name] = torch.full_like(out, 1e-3)
        out.backward(grads[name])
        _sync(device)
        return time.perf_counter() - start

    for name in kernels:  # warm-up
        step(name)
    for rep in range(REPS):
        if rep >= MIN_REPS and all(sum(t) > BUDGET_S for t in times.values()):
            break
        for name in kernels:
            times[name].append(step(name))
    return times


def steady(times: list[float]) -> bool:
    """Whether the two fastest of ``times`` agree within :data:`STEADY` (one step: trivially)."""
    fast = sorted(times)[:2]
    return len(fast) < 2 or fast[1] <= STEADY * fast[0]


def measure(
    backends: Mapping[str, type[BatchedEmbeddingKernel]],
    tables: list[TableSpec],
    feature_table: list[int],
    optim: FusedOptimConfig,
    *,
    pooled: bool,
    device: torch.device,
    workload: Workload,
) -> Measurement:
    """Fastest seconds per step of each backend on synthetic copies of ``tables`` (rows capped at ``ROW_CAP``);
    with the pooling not declared, the geometric mean of those at each of :data:`UNDECLARED_POOLINGS`."""
    if workload.pooling is None:
        parts = [
            measure(
                backends,
                tables,
                feature_table,
                optim,
                pooled=pooled,
                device=device,
                workload=replace(workload, pooling=p),
            )
            for p in UNDECLARED_POOLINGS
        ]
        out = Measurement({name: math.prod(m[name] for m in parts) ** (1 / len(parts)) for name in parts[0]})
        out.steady = all(m.steady for m in parts)
        return out
    small = [
        TableSpec(name=t.name, num_embeddings=min(t.num_embeddings, ROW_CAP), embedding_dim=t.embedding_dim)
        for t in tables
    ]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        kjt = synthetic_batch(len(feature_table), [small[t].num_embeddings for t in feature_table], workload, device)
        times = time_backends(backends, small, feature_table, optim, pooled=pooled, device=device, kjt=kjt)
    out = Measurement({name: min(t) for name, t in times.items()})
    out.steady = all(steady(t) for t in times.values())
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- cache ----------------------------------------------------------------------------------
def cache_dir() -> Path | None:
    """Where verdicts are kept; None when ``$LIGHTNING_SHARDREC_KERNEL_CACHE`` is ``off``/``0``."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.lower() in ("", "0", "off", "none") else Path(env)
    return user_cache_dir()


@functools.cache
def machine() -> str:
    """CPU model and vector ISA (and GPU name), torch and fbgemm versions: what a verdict holds for.

    The ISA is torch's CPU capability (``AVX512``, ``AVX2``, ...): one cloud CPU model comes with AVX-512 on
    some hosts and AVX2 on others, and both kernels run different code on each.
    """
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "-"
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{cpu} ({isa}) | {gpu} | torch {torch.__version__} | fbgemm {_fbgemm_version()}"


def _fbgemm_version() -> str:
    build = installed_build()
    return "-" if build is None else build.rsplit(" ", 1)[1]


def cache_key(
    tables: list[TableSpec], num_features: int, optim: FusedOptimConfig, pooled: bool, device: torch.device, w: Workload
) -> str:
    """Machine, optimizer, device, dims, and buckets (powers of 2) of rows, batch and pooling; on CPU which
    build of the torch kernel's compiled loops runs (or none: its tensor ops, a slower kernel).

    It starts with :data:`TIMING`: verdicts of an older timing method are never read back.
    """
    rows = sum(t.num_embeddings for t in tables)
    dims = ",".join(str(d) for d in sorted({t.embedding_dim for t in tables}))
    return (
        f"{TIMING} | {machine()} | {device.type} | {optim.optimizer.value} | {'pooled' if pooled else 'sequence'} | "
        f"dims {dims} | features {num_features} | rows 2^{_bucket(rows)} | batch 2^{_bucket(w.batch_size)} | "
        f"pooling {_pooling_key(w.pooling)}" + (f" | torch {native.loops_tag()}" if device.type == "cpu" else "")
    )


def _bucket(x: float) -> int:
    return round(math.log2(max(x, 1e-9)))


def _pooling_key(pooling: float | None) -> str:
    return (
        f"2^{_bucket(pooling)}"
        if pooling is not None
        else "undeclared " + ",".join(f"{p:g}" for p in UNDECLARED_POOLINGS)
    )


class VerdictCache:
    """``key -> Timings`` in ``<dir>/kernel_choice.json``, written atomically.

    The ranks of one machine write it at the same time (each its own groups), so a write
    re-reads and merges under an exclusive lock: no rank's verdict is lost.
    """

    def __init__(self, directory: Path | None) -> None:
        self.path = None if directory is None else directory / "kernel_choice.json"

    def get(self, key: str) -> Timings | None:
        hit = self._read().get(key)
        return None if not isinstance(hit, dict) else {str(k): float(v) for k, v in hit.items()}

    def put(self, key: str, seconds: Timings) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_name(self.path.name + ".lock")):
                data = self._read()
                data[key] = seconds
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home: time again next run

    def _read(self) -> dict[str, object]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _locked(path: Path):  # type: ignore[no-untyped-def]
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; elsewhere no lock)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- the choice -----------------------------------------------------------------------------
#: Sums timings over ranks (the group's ranks all call it in the same order); identity on one rank.
Agree = Callable[[Timings, list[str]], Timings]


def choose_kernel(
    kernel: KernelBackend,
    runnable: Mapping[KernelBackend, str | None],
    classes: Mapping[KernelBackend, type[BatchedEmbeddingKernel]],
    tables: list[TableSpec],
    feature_table: list[int],
    optim: FusedOptimConfig,
    *,
    pooled: bool,
    device: torch.device,
    workload: Workload,
    agree: Agree | None = None,
) -> KernelChoice:
    """The backend for one group: ``kernel`` (or the env pin), else the fastest runnable one.

    ``runnable`` maps each backend to None (can run here) or why not. With ``agree``, every
    rank passes its local timings (empty when it holds no shard) and gets the group's sums
    back, so all ranks keep the same backend; a backend any rank cannot run is left out.
    """
    pinned = pinned_backend(kernel)
    if pinned is not KernelBackend.AUTO:
        return KernelChoice(backend=pinned, source="pinned")
    names = [b.value for b in classes]
    ok = [b for b in classes if runnable.get(b) is None]
    note = "; ".join(r for r in runnable.values() if r)
    local: Timings = {}
    cached: Timings | None = None
    if tables and len(ok) > 1:
        key = cache_key(tables, len(feature_table), optim, pooled, device, workload)
        cache = VerdictCache(cache_dir())
        cached = cache.get(key)
        if cached is not None and set(cached) >= {b.value for b in ok}:
            local = {b.value: cached[b.value] for b in ok}
        else:
            local = measure(
                {b.value: classes[b] for b in ok}, tables, feature_table, optim,
                pooled=pooled, device=device, workload=workload,
            )  # fmt: skip
            if getattr(local, "steady", True):  # a noisy measurement decides this run only
                cache.put(key, dict(local))
    source = "cached" if local and cached is not None and set(cached) >= set(local) else "measured"
    if agree is not None:
        # a backend this rank cannot run counts as infinitely slow everywhere
        local = {n: local.get(n, 0.0) if KernelBackend(n) in ok else math.inf for n in names}
        summed = agree(local, names)
        ok = [b for b in ok if math.isfinite(summed[b.value])]
        local = {b.value: summed[b.value] for b in ok} if any(summed[b.value] for b in ok) else {}
    if not local or len(ok) == 1:
        return KernelChoice(backend=ok[0] if ok else KernelBackend.TORCH, source="only", note=note)
    best = min(ok, key=lambda b: local[b.value])
    return KernelChoice(backend=best, source=source, seconds=local, note=note)
