"""Per-rank memory the planner may fill: the device's capacity less a reserve.

Embedding tables are not alone on a GPU: the dense model and its optimizer state,
activations, communication buffers, the CUDA context and the caching allocator's slack
need memory too, and the planner cannot see them. Like TorchRec's storage reservation,
it keeps a fraction of every rank's capacity (``reserve``, default 15%) out of the
tables' budget::

    budget = capacity * (1 - reserve)       # what tables, optimizer state and buffers may use

A plan whose fullest rank needs more than ``budget`` is refused with this arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3

DEFAULT_RESERVE = 0.15
RESERVED_FOR = (
    "the dense model and its optimizer, activations, communication buffers, "
    "the CUDA context and allocator slack"
)


#: what a CPU rank holds besides its tables, measured (docs/benchmarks.md, issue 29): the process itself
#: (interpreter, torch, Lightning: ~0.45 GiB resident after a first step) plus the run's buffers, a
#: step's activations and the checkpoint pieces in flight (<= 64 MiB over the share at every phase)
RANK_ALLOWANCE = 640 * 2**20


def peak_line(max_storage: int, capacity: int, allowance: int = RANK_ALLOWANCE) -> str:
    """``estimated peak per rank: 1.20 GiB (tables, optimizer state, buffers) + 0.62 GiB allowance = ...``."""
    total = max_storage + allowance
    verdict = "fits" if total <= capacity else "DOES NOT FIT"
    return (
        f"estimated peak per rank: {size_text(max_storage)} (fullest rank: tables, optimizer state, buffers) + "
        f"{size_text(allowance)} allowance (process and run, measured on CPU ranks) = {size_text(total)} of "
        f"{size_text(capacity)} capacity: {verdict}"
    )


def check_reserve(reserve: object, where: str = "reserve") -> float:
    """``reserve`` as a float in ``[0, 1)``, else a ``ValueError`` naming ``where``."""
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0.0 <= reserve < 1.0:
        raise ValueError(
            f"{where} is the fraction of each rank's memory kept free for {RESERVED_FOR}; "
            f"it must be a number in [0, 1), got {reserve!r} (default {DEFAULT_RESERVE})"
        )
    return float(reserve)


@dataclass(frozen=True)
class MemoryBudget:
    """``capacity`` bytes per rank, of which ``reserve`` (a fraction) is kept free."""

    capacity: int
    reserve: float = DEFAULT_RESERVE

    @property
    def tables(self) -> int:
        """Bytes per rank that tables, their optimizer state and buffers may use."""
        return int(self.capacity * (1.0 - self.reserve))

    @property
    def reserved(self) -> int:
        return self.capacity - self.tables

    def describe(self) -> str:
        """``80.00 GiB capacity - 15% reserve (12.00 GiB) = 68.00 GiB for tables``."""
        return (
            f"{size_text(self.capacity)} capacity - {self.reserve:.0%} reserve "
            f"({size_text(self.reserved)}) = {size_text(self.tables)} for tables"
        )


def size_text(nbytes: float) -> str:
    """``12.00 GiB``; below 0.01 GiB in MiB (``3.20 MiB``) so small figures stay readable."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 100 else f"{nbytes / 2**20:.2f} MiB"


def host_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup/memory.max") -> int | None:
    """Bytes of memory this host gives its processes: ``MemTotal``, or the cgroup's limit when lower
    (a container); None where neither can be read (not Linux). The ranks on a host share it."""
    found: list[int] = []
    try:
        with open(meminfo) as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(cgroup) as f:
            limit = f.read().strip()
        if limit.isdigit():
            found.append(int(limit))
    except OSError:
        pass
    return min(found) if found else None


def cuda_capacity(index: int | None = None) -> tuple[int, str] | None:
    """``(total bytes, device name)`` of CUDA device ``index`` (default: the current one), or None
    when no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    return int(props.total_memory), f"cuda:{idx} {props.name}"
