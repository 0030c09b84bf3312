"""``EmbeddingShardingPlanner`` at TorchRec's path (``torchrec.distributed.planner.planners``), and
TorchRec's ``validate_compute_kernels``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterSharding, ShardingPlan

_KERNELS = ("fused", "dense")


def _entries(best_plan: Any) -> Iterable[tuple[str, str, str]]:
    """(name, kernel, sharding type) of each entry of a plan, a table -> sharding mapping, or TorchRec-style
    sharding options (objects with ``fqn`` or ``name``, ``compute_kernel`` and ``sharding_type``)."""
    if isinstance(best_plan, ShardingPlan):
        for path, tables in best_plan.plan.items():
            for name, ps in tables.items():
                yield (f"{path}.{name}" if path else name), str(ps.compute_kernel), str(ps.sharding_type)
    elif isinstance(best_plan, Mapping):
        for name, ps in best_plan.items():
            yield str(name), str(ps.compute_kernel), str(ps.sharding_type)
    else:
        for so in best_plan:
            label = getattr(so, "fqn", None) or getattr(so, "name", "?")
            yield str(label), str(so.compute_kernel), str(so.sharding_type)


def validate_compute_kernels(best_plan: ShardingPlan | Mapping[str, ParameterSharding] | Iterable[Any]) -> None:
    """Raise :class:`PlannerError` listing every entry whose kernel is unknown here (``fused`` and ``dense``
    exist; TorchRec's UVM, caching and key-value kernels do not) or does not match its sharding type
    (``dense`` is ``data_parallel``'s kernel and only its)."""
    violations: list[str] = []
    for name, kernel, kind in _entries(best_plan):
        if kernel not in _KERNELS:
            violations.append(f"{name}: unknown compute kernel '{kernel}' (valid here: {', '.join(_KERNELS)})")
        elif (kernel == "dense") != (kind == "data_parallel"):
            violations.append(
                f"{name}: DENSE kernel requires DATA_PARALLEL sharding, got '{kind}'"
                if kernel == "dense"
                else f"{name}: DATA_PARALLEL sharding requires the DENSE kernel, got '{kernel}'"
            )
    if violations:
        raise PlannerError(
            f"Compute kernel validation failed with {len(violations)} violation(s):\n"
            + "\n".join(f"  - {v}" for v in violations)
        )


__all__ = ["EmbeddingShardingPlanner", "validate_compute_kernels"]
