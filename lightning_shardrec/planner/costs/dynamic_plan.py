"""What a plan shows about its dynamic tables: capacity as buckets x slots, and memory with the id map.

A dynamic table's rows are slots that raw ids are admitted into; besides its weights
and optimizer state, its id map holds 4 int64 per slot (and a 4-byte window bitmap) and 3 per admission candidate
(plus 5 counters per bucket), and the planner counts those bytes like the weights
(:func:`~lightning_shardrec.planner.costs.storage.id_map_bytes`). The plan printout lists::

    dynamic tables (raw int64 ids -> slots):
      <root>.t_user: capacity 4096 = 256 buckets x 16 slots, 16 candidates/bucket;
        memory 1.23 MiB = weights 0.50 MiB + optimizer state 0.50 MiB + id map 0.23 MiB
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from lightning_shardrec.planner.costs.perf import Workload
from lightning_shardrec.planner.costs.storage import id_map_bytes, resident_bytes
from lightning_shardrec.planner.machine.memory import size_text
from lightning_shardrec.planner.plans.tables import TableSpec


@dataclass(frozen=True, kw_only=True)
class DynamicLayout:
    """One dynamic table as planned: its buckets and the bytes of the whole table."""

    num_buckets: int
    slots_per_bucket: int
    cands_per_bucket: int
    weight_bytes: int
    state_bytes: int
    id_map_bytes: int

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.slots_per_bucket

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes + self.id_map_bytes

    def describe(self) -> str:
        cands = f"{self.cands_per_bucket} candidates/bucket" if self.cands_per_bucket else "no candidates (min_count 1)"
        return (
            f"capacity {self.capacity} = {self.num_buckets} buckets x {self.slots_per_bucket} slots, {cands}; "
            f"memory {size_text(self.total_bytes)} = weights {size_text(self.weight_bytes)} + optimizer state "
            f"{size_text(self.state_bytes)} + id map {size_text(self.id_map_bytes)}"
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


DynamicLayouts = Mapping[str, Mapping[str, DynamicLayout]]
"""module path -> table name -> :class:`DynamicLayout` (dynamic tables only)."""


def dynamic_layouts(specs: Sequence[TableSpec], work: Workload) -> dict[str, dict[str, DynamicLayout]]:
    """The layout of every dynamic table among ``specs``."""
    out: dict[str, dict[str, DynamicLayout]] = {}
    for spec in specs:
        if spec.num_buckets:
            weights, state = resident_bytes(spec, work)
            out.setdefault(spec.path, {})[spec.name] = DynamicLayout(
                num_buckets=spec.num_buckets,
                slots_per_bucket=spec.slots_per_bucket,
                cands_per_bucket=spec.cands_per_bucket,
                weight_bytes=weights,
                state_bytes=state,
                id_map_bytes=id_map_bytes(spec),
            )
    return out


def dynamic_lines(layouts: DynamicLayouts) -> list[str]:
    """The printout's section on dynamic tables (empty without any)."""
    if not any(layouts.values()):
        return []
    lines = ["", "dynamic tables (raw int64 ids -> slots):"]
    for path in sorted(layouts):
        for name in sorted(layouts[path]):
            lines.append(f"  {path or '<root>'}.{name}: {layouts[path][name].describe()}")
    return lines


def layouts_from_dict(data: Mapping[str, Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, DynamicLayout]]:
    """Inverse of the ``to_dict`` of every layout (``ShardingPlan.from_json``)."""
    return {path: {name: DynamicLayout(**d) for name, d in tables.items()} for path, tables in data.items()}
