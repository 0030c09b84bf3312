"""``ShardingPlan``: module path -> table name -> ``ParameterSharding``, plus its estimates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_shardrec.planner.costs.dynamic_plan import (
    DynamicLayout,
    DynamicLayouts,
    dynamic_lines,
    layouts_from_dict,
)
from lightning_shardrec.planner.machine.memory import DEFAULT_RESERVE, RESERVED_FOR, MemoryBudget, size_text
from lightning_shardrec.planner.plans.types import ParameterSharding, ShardingType, torchrec_repr

GiB = 1024**3


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """The planner's estimates for a plan: per-rank bytes and step seconds.

    ``storage_cap`` is each rank's memory capacity; the planner kept ``reserve`` of it
    (a fraction) free, so every rank's tables fit in ``storage_cap * (1 - reserve)``.
    """

    rank_storage: Sequence[float]  # bytes, stored as a tuple of ints
    rank_cost: Sequence[float]  # seconds per step, stored as a tuple
    storage_cap: int
    lower_bound: float
    reserve: float = 0.0
    #: calibrated plans only (``Topology(rates=...)``): per phase of each group, every rank's seconds in it
    phase_cost: Mapping[str, Sequence[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_storage", tuple(int(x) for x in self.rank_storage))
        object.__setattr__(self, "rank_cost", tuple(float(x) for x in self.rank_cost))
        phases = {k: tuple(float(x) for x in v) for k, v in self.phase_cost.items()}
        object.__setattr__(self, "phase_cost", phases)

    @property
    def max_cost(self) -> float:
        return max(self.rank_cost)

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank estimated cost (1.0 = perfectly balanced)."""
        mean = sum(self.rank_cost) / len(self.rank_cost)
        return self.max_cost / mean if mean > 0 else 1.0

    @property
    def vs_lower_bound(self) -> float:
        """max-rank cost / lower bound (total of each table's cheapest arrangement / world size)."""
        return self.max_cost / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def max_storage(self) -> int:
        return int(max(self.rank_storage))

    @property
    def headroom(self) -> int:
        """Bytes left on the fullest rank: capacity - its tables."""
        return self.storage_cap - self.max_storage

    @property
    def tight(self) -> bool:
        """The fullest rank leaves less than the default reserve free (a plan made with a lower reserve)."""
        return self.headroom < MemoryBudget(self.storage_cap, DEFAULT_RESERVE).reserved

    def verdict(self) -> str:
        """One line: max rank GiB / capacity / headroom, and whether that leaves the reserve free."""
        budget = MemoryBudget(self.storage_cap, self.reserve)
        cap, peak, head = self.storage_cap, self.max_storage, self.headroom
        line = (
            f"verdict: max rank {size_text(peak)} / capacity {size_text(cap)} / "
            f"headroom {size_text(head)} ({head / cap if cap else 0.0:.0%})"
        )
        if peak > budget.tables:
            return f"{line}: DOES NOT FIT the {self.reserve:.0%} reserve ({budget.describe()})"
        if self.tight:
            return (
                f"{line}: WARNING, less than the default {DEFAULT_RESERVE:.0%} "
                f"({size_text(DEFAULT_RESERVE * cap)}) left for {RESERVED_FOR}"
            )
        return f"{line}: fits, with the {self.reserve:.0%} reserve ({size_text(budget.reserved)}) kept free"

    def to_dict(self) -> dict[str, object]:
        return {
            "rank_storage": list(self.rank_storage),
            "rank_cost": list(self.rank_cost),
            "storage_cap": self.storage_cap,
            "lower_bound": self.lower_bound,
            "reserve": self.reserve,
            **({"phase_cost": {k: list(v) for k, v in self.phase_cost.items()}} if self.phase_cost else {}),
        }


class ModuleShardingPlan:
    """TorchRec's base class of one module's plan (for ``isinstance`` checks and annotations)."""


class EmbeddingModuleShardingPlan(ModuleShardingPlan, dict[str, ParameterSharding]):
    """One collection's plan, ``{table: ParameterSharding}`` (TorchRec's ``plan.plan[path]``): a dict."""


@dataclass(frozen=True)
class ShardingPlan:
    """How every table of every collection is sharded (``==`` compares only ``plan``).

    ``dynamic``: the planner's layout of each dynamic table (capacity, memory with its id map).
    """

    plan: dict[str, dict[str, ParameterSharding]]
    stats: PlanStats | None = field(default=None, compare=False, kw_only=True)
    dynamic: DynamicLayouts = field(default_factory=dict, compare=False, kw_only=True)
    #: where the shards live, for TorchRec's ``placement`` text in ``repr`` (``"cpu"``, ``"cuda"``)
    compute_device: str = field(default="cpu", compare=False, kw_only=True)
    local_world_size: int = field(default=1, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        # each module's tables as TorchRec's EmbeddingModuleShardingPlan (a dict), whatever mapping was given
        plan = {
            path: tables if isinstance(tables, EmbeddingModuleShardingPlan) else EmbeddingModuleShardingPlan(tables)
            for path, tables in self.plan.items()
        }
        object.__setattr__(self, "plan", plan)

    def __repr__(self) -> str:
        """TorchRec's ``repr`` of the same plan: ``ShardingPlan(plan={path: {table: ParameterSharding(...)}})``."""
        modules = ", ".join(
            f"{path!r}: {{"
            + ", ".join(
                f"{name!r}: {torchrec_repr(ps, self.compute_device, self.local_world_size)}"
                for name, ps in tables.items()
            )
            + "}"
            for path, tables in self.plan.items()
        )
        return f"ShardingPlan(plan={{{modules}}})"

    def get_plan_for_module(self, module_path: str) -> dict[str, ParameterSharding] | None:
        """The table shardings of the collection at ``module_path`` (``""`` = root), or None."""
        return self.plan.get(module_path)

    def to_json(self, indent: int | None = 2) -> str:
        data: dict[str, object] = {
            "plan": {
                path: {name: ps.to_dict() for name, ps in tables.items()}
                for path, tables in self.plan.items()
            },
            "stats": None if self.stats is None else self.stats.to_dict(),
            "compute_device": self.compute_device,
            "local_world_size": self.local_world_size,
        }
        if any(self.dynamic.values()):
            data["dynamic"] = {p: {n: d.to_dict() for n, d in t.items()} for p, t in self.dynamic.items()}
        return json.dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"ShardingPlan.from_json: not valid JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("plan"), dict):
            raise ValueError('ShardingPlan.from_json: expected an object with a "plan" key')
        bad = [path for path, tables in data["plan"].items() if not isinstance(tables, dict)]
        if bad:
            raise ValueError(f"ShardingPlan.from_json: module {bad[0]!r} must map table names to shardings")
        plan = {
            path: {name: ParameterSharding.from_dict(ps, name) for name, ps in tables.items()}
            for path, tables in data["plan"].items()
        }
        stats = data.get("stats")
        dynamic = layouts_from_dict(data.get("dynamic") or {})
        device, local = data.get("compute_device", "cpu"), data.get("local_world_size", 1)
        if not isinstance(device, str) or not isinstance(local, int) or isinstance(local, bool) or local < 1:
            raise ValueError(
                "ShardingPlan.from_json: compute_device must be a device type string (\"cpu\", \"cuda\") and "
                f"local_world_size an int >= 1, got {device!r} and {local!r}"
            )
        stats_ = None if stats is None else PlanStats(**stats)
        return cls(plan, stats=stats_, dynamic=dynamic, compute_device=device, local_world_size=local)

    def __str__(self) -> str:
        return self.table()

    def table(self, kernels: Mapping[tuple[str, str], str] | None = None) -> str:
        """The plan as a table; ``kernels`` ((module path, table) -> the backend chosen and why,
        e.g. ``"fbgemm (1.9x torch)"``) fills the ``kernel`` column once the tables are sharded."""
        kernels = kernels or {}
        header = (
            "module",
            "param",
            "sharding type",
            "kernel",
            "ranks",
            "shards (rank: offsets sizes)",
        )
        rows = [header]
        for path in sorted(self.plan):
            for name in sorted(self.plan[path]):
                ps = self.plan[path][name]
                rows.append(
                    (
                        path or "<root>",
                        _param(name, self.dynamic.get(path, {}).get(name)),
                        ps.sharding_type.value,
                        _kernel(ps, kernels.get((path, name))),
                        _ranks(ps),
                        _shards(ps),
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = [
            " | ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + " | " + r[-1]
            for r in rows
        ]
        lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * len(header[-1]))
        lines.extend(dynamic_lines(self.dynamic))
        if self.stats is not None:
            lines.extend(_stats_lines(self.stats))
        return "\n".join(lines)


def _param(name: str, dynamic: DynamicLayout | None) -> str:
    return name if dynamic is None else f"{name} (dynamic, {dynamic.capacity} slots)"


def _kernel(ps: ParameterSharding, chosen: str | None) -> str:
    return ps.compute_kernel.value if chosen is None else f"{ps.compute_kernel.value}: {chosen}"


def _ranks(ps: ParameterSharding) -> str:
    ranks = list(ps.ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def _shards(ps: ParameterSharding) -> str:
    if ps.sharding_type is ShardingType.DATA_PARALLEL and ps.shards:
        s = ps.shards[0]
        return f"full [{s.shard_sizes[0]}, {s.shard_sizes[1]}] on each of {len(ps.shards)} ranks"
    return " ".join(
        f"r{s.rank}:[{s.shard_offsets[0]},{s.shard_offsets[1]}]+[{s.shard_sizes[0]},{s.shard_sizes[1]}]"
        for s in ps.shards
    )


def _stats_lines(stats: PlanStats) -> list[str]:
    lines = ["", "rank | storage (bytes) | storage (GiB) | used | est. cost (ms/step)"]
    for r, (mem, cost) in enumerate(zip(stats.rank_storage, stats.rank_cost, strict=True)):
        used = mem / stats.storage_cap if stats.storage_cap else 0.0
        lines.append(f"{r:>4} | {mem:>15} | {mem / GiB:>13.3f} | {used:>4.0%} | {cost * 1e3:.4f}")
    lines.append(
        f"max cost {stats.max_cost * 1e3:.4f} ms, imbalance (max/mean) {stats.imbalance:.3f}, "
        f"lower bound {stats.lower_bound * 1e3:.4f} ms (max/bound {stats.vs_lower_bound:.3f})"
    )
    lines.append(stats.verdict())
    return lines


#: a plan given whole or in part: the tables it pins (``EmbeddingShardingPlanner.plan(module, fixed=...)``)
FixedPlan = ShardingPlan | Mapping[str, ParameterSharding]
