"""Measured rates of one machine (``benchmarks/calibrate.py``), for an opt-in calibrated cost model.

Without rates the cost model is bandwidth only (``DEVICE_DEFAULTS``). With ``Topology(rates=...)``
it also charges what a measured step shows on a loaded CPU cluster:

- ``memory_bw`` (bytes/s) and ``lookup_seconds`` (s per shard lookup + fused update, the
  kernel's fixed cost): a kernel step of ``n`` bytes takes ``lookup_seconds + n / memory_bw``,
  fitted over several table shapes;
- ``intra_host_bw`` / ``inter_host_bw`` (bytes/s) of an all-to-all, and ``collective_seconds``
  (s per collective call, the latency a small all-to-all shows);
- ``allreduce_bw`` (bytes/s): a data-parallel gradient all-reduce (ring bytes ``2 (W-1)/W`` of it);
- ``step_seconds`` (s): a measured step of a one-row table-wise model: the dense model and its
  all-reduce, one lookup and the collectives of one sharding type; ``table_seconds`` (s) per
  further table (each table's features are split, sent and pooled on every rank: Python per table).

:func:`step_estimate` adds the latency of the collectives of every further sharding type a plan
uses (table_row_wise and grid_shard: also their holders' reduction).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

#: collectives one sharding type issues per training step: ids (lengths, values), output, gradient
COLLECTIVES_PER_TYPE = 4
#: table_row_wise / grid_shard also reduce among the holders, forward and backward
COLLECTIVES_HOLDERS = 2
#: data_parallel tables: one gradient all-reduce per step
COLLECTIVES_DATA_PARALLEL = 1


@dataclass(frozen=True, kw_only=True)
class Rates:
    """One machine's measured rates (bytes/s, seconds); ``source`` says where and how they were measured."""

    memory_bw: float
    lookup_seconds: float
    intra_host_bw: float
    inter_host_bw: float
    collective_seconds: float
    allreduce_bw: float
    step_seconds: float = 0.0
    table_seconds: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "source":
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
        missing = sorted(
            f.name
            for f in fields(cls)
            if f.name not in data and f.name not in ("step_seconds", "table_seconds", "source")
        )
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


def collectives(plan: Any) -> int:
    """Collective calls a ``ShardingPlan`` issues per step beyond those of the fixed step (one sharding type's)."""
    kinds = {ps.sharding_type.value for tables in plan.plan.values() for ps in tables.values()}
    calls = COLLECTIVES_DATA_PARALLEL if "data_parallel" in kinds else 0
    calls += COLLECTIVES_PER_TYPE * max(0, len(kinds - {"data_parallel"}) - 1)
    calls += COLLECTIVES_HOLDERS * len(kinds & {"table_row_wise", "grid_shard"})
    return calls


def step_estimate(plan: Any, rates: Rates) -> float:
    """Seconds per training step: the slowest rank's cost, the fixed step and the further collectives' latency."""
    tables = sum(len(t) for t in plan.plan.values())
    fixed = rates.step_seconds + rates.table_seconds * max(0, tables - 1)
    return float(plan.stats.max_cost) + fixed + rates.collective_seconds * collectives(plan)
