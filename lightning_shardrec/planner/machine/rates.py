"""Measured rates of one machine (``benchmarks/calibrate.py``), for an opt-in calibrated cost model.

Without rates the cost model is bandwidth only (``DEVICE_DEFAULTS``). With ``Topology(rates=...)``
it also charges what a measured step shows on a loaded CPU cluster:

- ``memory_bw`` (bytes/s) and ``lookup_seconds`` (s per shard lookup + fused update, the
  kernel's fixed cost): a kernel step of ``n`` bytes per id takes ``lookup_seconds + n / memory_bw``,
  fitted on tables whose rows stay in cache (rows read from memory: ``row_seconds``, ``row_byte_seconds``);
- ``intra_host_bw`` / ``inter_host_bw`` (bytes/s) of an all-to-all's bytes (the slope between two sizes,
  slowed by as much as a wide tiny table's all-to-alls show inside a step);
- ``reduce_scatter_bw`` (bytes/s): row_wise's reduce-scatter of the pooled partial and the all-gather
  of its gradient, by the ``(W-1)/W`` of it that leaves a rank (gloo's are slower than an all-to-all);
- ``allreduce_bw`` (bytes/s): what DDP's all-reduce of a replicated table's gradient adds to its step,
  by ring bytes ``2 (W-1)/W`` of the table (bucketed, overlapping the backward);
- ``dense_bw`` (table bytes/s): what a replicated table's step costs besides its all-reduce: its dense
  gradient (the whole table) and the dense optimizer's update of the whole table, measured with adagrad;
- ``step_seconds`` (s): a step of a tiny replicated table: the dense model, its all-reduce, the header
  all-to-all and Python, no sharded group (:data:`BASE_CALLS`);
- what a call costs inside a step (s), measured on tiny tables by the calls each group adds
  (:data:`MECHANISM_CALLS`): ``collective_seconds`` per all-to-all (or further all-reduce),
  ``host_call_seconds`` per in-host all-to-all, ``reduce_scatter_seconds`` per reduce-scatter or
  all-gather. On a CPU a call waits for every rank to be scheduled, so these are far above an idle
  all-to-all's latency;
- ``group_seconds`` (s) per sharded group beyond the first (its output split and joined) and
  ``table_seconds`` (s) per further piece (a table, or each column piece of a column-wise or grid
  table: each gets its own copy of the ids, its own lookup and its own block of the output), and
  ``host_table_seconds`` (s) what a table_row_wise / grid_shard piece adds to that (its partial is
  also reduced among its holders), both measured on six tiny tables against one;

- ``row_seconds`` (s per row) and ``row_byte_seconds`` (s per byte): what a lookup and its fused update
  pay, inside a step, per distinct row they touch (``perf.distinct_rows``: a cache miss) and per byte of
  those rows (weights and optimizer state). Measured as twelve tables of many rows, 64 and 16 wide,
  against twelve of 4 rows, every rank updating three;

- ``ranks_per_core``: ranks per CPU core where ``measure`` ran (its ranks / ``os.cpu_count()``, at least
  1). Its kernel rates were timed with every rank computing at once; a rank that computes while
  others wait runs that many times faster, but the ranks together never beat the shared rate.

:func:`step_estimate` is the plan's critical path (:func:`critical_path`: a step is phases between
collectives, each as long as its slowest rank) plus the fixed step, the calls a plan makes beyond the
fixed step's, counted per mechanism from its sharding types (:func:`step_calls`), each at its kind's
in-step seconds, and the further groups and tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, astuple, dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

#: DDP's gradient bucket (``bucket_cap_mb=25``): replicated tables' gradients join the dense all-reduce
DDP_BUCKET_BYTES = 25 * 1024**2


@dataclass(frozen=True)
class Calls:
    """Collective calls of one training step, by kind (``host_all_to_all``: on a host's group)."""

    all_to_all: int = 0
    host_all_to_all: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    all_reduce: int = 0

    def __add__(self, other: Calls) -> Calls:
        return Calls(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: Calls) -> Calls:
        return Calls(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def total(self) -> int:
        return sum(astuple(self))


#: Per mechanism (the sharding types one group runs together, ``distributed/sharding``), the calls it
#: makes per step, counted in a step (``benchmarks/calibrate.py check``): ids in (lengths, values),
#: the pooled output and its gradient; row_wise reduce-scatters the output and all-gathers its gradient;
#: table_row_wise / grid_shard also reduce among a piece's holders inside the host, and back.
#: data_parallel tables make none of their own: their gradient joins DDP's all-reduce.
MECHANISM_CALLS: dict[frozenset[str], Calls] = {
    frozenset({"table_wise", "column_wise"}): Calls(all_to_all=2),  # pooled rows home, their gradients back
    frozenset({"row_wise"}): Calls(reduce_scatter=1, all_gather=1),
    frozenset({"table_row_wise", "grid_shard"}): Calls(all_to_all=2, host_all_to_all=2),
    frozenset({"data_parallel"}): Calls(),
}
#: per sharded collection and step with a sharded group: one all-to-all for every group's lengths, ids and
#: weights (``distributed.comm.input_dist.PackedExchange``)
INPUT_CALLS = Calls(all_to_all=1)
#: per sharded collection and step: the header all-to-all (batch sizes, id counts)
HEADER_CALLS = Calls(all_to_all=1)
#: what the fixed step (``Rates.step_seconds``: a tiny replicated table) makes: the header and the dense
#: model's all-reduce
BASE_CALLS = HEADER_CALLS + Calls(all_reduce=1)


@dataclass(frozen=True, kw_only=True)
class Rates:
    """One machine's measured rates (bytes/s, seconds); ``source`` says where and how they were measured."""

    memory_bw: float
    lookup_seconds: float
    intra_host_bw: float
    inter_host_bw: float
    reduce_scatter_bw: float
    allreduce_bw: float
    dense_bw: float
    step_seconds: float
    collective_seconds: float
    host_call_seconds: float
    reduce_scatter_seconds: float
    group_seconds: float
    table_seconds: float
    host_table_seconds: float = 0.0
    row_seconds: float = 0.0
    row_byte_seconds: float = 0.0
    ranks_per_core: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_core, int | float) or not self.ranks_per_core >= 1:
            raise ValueError(f"Rates: ranks_per_core must be a number >= 1, got {self.ranks_per_core!r}")
        for f in fields(self):
            if f.name in ("source", "ranks_per_core"):
                continue
            value = getattr(self, f.name)
            positive = f.name.endswith("_bw")
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0 or (positive and value == 0):
                need = "> 0" if positive else ">= 0"
                raise ValueError(f"Rates: {f.name} must be a finite number {need}, got {value!r}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Rates:
        """Rates from a JSON file ``benchmarks/calibrate.py`` wrote; unknown or missing keys are named."""
        data: Any = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict):
            raise ValueError(f"Rates file {path}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Rates file {path}: unknown keys {unknown}; valid: {sorted(names)}")
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.name not in optional)
        if missing:
            raise ValueError(f"Rates file {path}: missing keys {missing}")
        return cls(**data)


def as_rates(rates: Rates | str | Path | None) -> Rates | None:
    """``rates`` itself, or loaded from the path given (``Topology(rates=...)`` takes either)."""
    if rates is None or isinstance(rates, Rates):
        return rates
    if isinstance(rates, str | Path):
        return Rates.load(rates)
    raise TypeError(f"Topology: rates must be a Rates or a path to a rates file, got {type(rates).__name__}")


def step_calls(plan: Any, local_world_size: int) -> Calls:
    """The collective calls one training step of ``plan`` makes, by kind, from its sharding types and tables.

    Per collection: the header, the packed input exchange (:data:`INPUT_CALLS`, where a group is
    sharded) and each mechanism's :data:`MECHANISM_CALLS` (the host all-to-alls only with several
    ranks per host); DDP's all-reduce: one per :data:`DDP_BUCKET_BYTES` of
    replicated tables, at least one (the dense model's).
    """
    calls, replicated = Calls(), 0
    for tables in plan.plan.values():
        kinds = {ps.sharding_type.value for ps in tables.values()}
        calls += HEADER_CALLS
        if kinds - {"data_parallel"}:
            calls += INPUT_CALLS
        for types, made in MECHANISM_CALLS.items():
            if kinds & types:
                calls += made if local_world_size > 1 else replace(made, host_all_to_all=0)
        for ps in tables.values():
            if ps.sharding_type.value == "data_parallel":
                rows, cols = ps.shards[0].shard_sizes
                replicated += rows * cols * 4
    return calls + Calls(all_reduce=max(1, math.ceil(replicated / DDP_BUCKET_BYTES)))


#: sharding types whose pieces are also reduced among their holders in a host
HOST_TYPES = frozenset({"table_row_wise", "grid_shard"})


def pieces(plan: Any) -> tuple[int, int]:
    """Pieces a step handles (a table, or each column range of a column-wise or grid table), and how many
    of them are table_row_wise / grid_shard pieces."""
    total = host = 0
    for tables in plan.plan.values():
        for ps in tables.values():
            n = len({s.shard_offsets[1] for s in ps.shards}) if ps.sharding_type.value != "data_parallel" else 1
            total += n
            host += n if ps.sharding_type.value in HOST_TYPES else 0
    return total, host


def groups(plan: Any) -> int:
    """Sharded groups a step runs: per collection, one per mechanism its sharded tables use (replicated
    tables are looked up locally, with no collective of their own)."""
    return sum(
        sum(
            1
            for types in MECHANISM_CALLS
            if "data_parallel" not in types and types & {ps.sharding_type.value for ps in tables.values()}
        )
        for tables in plan.plan.values()
    )


def collectives(plan: Any, local_world_size: int) -> Calls:
    """The calls a ``ShardingPlan``'s step makes beyond the fixed step's (:data:`BASE_CALLS`); a kind may be < 0."""
    return step_calls(plan, local_world_size) - BASE_CALLS


def calls_seconds(calls: Calls, rates: Rates) -> float:
    """``calls`` at their kinds' in-step seconds (a further all-reduce: an all-to-all's)."""
    return (
        (calls.all_to_all + calls.all_reduce) * rates.collective_seconds
        + calls.host_all_to_all * rates.host_call_seconds
        + (calls.reduce_scatter + calls.all_gather) * rates.reduce_scatter_seconds
    )


#: phases where ranks compute (``perf.COMPUTE_PHASES``), named as in ``PlanStats.phase_cost``'s keys
COMPUTE_PHASES = ("lookup", "update")


def phase_seconds(phase: str, per_rank: tuple[float, ...] | list[float], ranks_per_core: float) -> float:
    """How long a phase takes, from each rank's seconds in it (``ranks_per_core`` = 1: the slowest rank's).

    A compute phase at rates timed with ``s`` ranks per core: no shorter than the slowest rank's
    seconds alone (``max / s``), nor than the ranks' work spread over all cores (their mean).
    """
    slowest = max(per_rank)
    if phase.split("/")[0] not in COMPUTE_PHASES or ranks_per_core == 1:
        return slowest
    return max(slowest / ranks_per_core, sum(per_rank) / len(per_rank))


def critical_path(plan: Any, rates: Rates) -> float:
    """Seconds of a plan's shard work when every phase lasts as long as its slowest rank
    (:func:`phase_seconds` over ``plan.stats.phase_cost``; a plan without phases: its slowest rank's total)."""
    phases = plan.stats.phase_cost
    if not phases:
        return float(plan.stats.max_cost)
    return sum(phase_seconds(name, per_rank, rates.ranks_per_core) for name, per_rank in phases.items())


class TopologyLike(Protocol):
    """What :func:`step_estimate` reads of a :class:`~lightning_shardrec.planner.machine.topology.Topology`
    (which is built on this module: it loads its ``rates`` here)."""

    @property
    def world_size(self) -> int: ...

    @property
    def num_hosts(self) -> int: ...

    @property
    def rates(self) -> Rates | None: ...


def step_estimate(plan: Any, topology: TopologyLike) -> float:
    """Seconds per training step of ``plan`` on ``topology`` (calibrated: ``Topology(rates=...)``).

    The plan's :func:`critical_path`, the fixed step, the calls beyond the fixed step's
    (:func:`collectives`, :func:`calls_seconds`), and the further groups and pieces (:func:`pieces`).
    """
    rates = topology.rates
    if rates is None:
        raise ValueError(
            "step_estimate: the topology has no measured rates; build it with Topology(..., rates='rates.json') "
            "(benchmarks/calibrate.py measure writes the file)"
        )
    total, host = pieces(plan)
    fixed = (
        rates.step_seconds
        + rates.table_seconds * max(0, total - 1)
        + rates.host_table_seconds * max(0, host - 1)
        + rates.group_seconds * max(0, groups(plan) - 1)
    )
    calls = calls_seconds(collectives(plan, topology.world_size // topology.num_hosts), rates)
    return critical_path(plan, rates) + fixed + calls
