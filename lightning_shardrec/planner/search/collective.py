"""The only distributed part of planning: agree on one plan across ranks."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from lightning_shardrec.errors import PlannerError
from lightning_shardrec.planner.plans.sharding_plan import FixedPlan, ShardingPlan
from lightning_shardrec.planner.plans.tables import TablesInput


class Planner(Protocol):
    """What :func:`collective_plan` runs on rank ``src``: an
    :class:`~lightning_shardrec.planner.search.planner.EmbeddingShardingPlanner` (built on this module)."""

    def plan(self, module: TablesInput, *, fixed: FixedPlan | None = None) -> ShardingPlan: ...


def collective_plan(
    planner: Planner,
    module: TablesInput,
    fixed: FixedPlan | None = None,
    pg: Any = None,
    src: int = 0,
) -> ShardingPlan:
    """Plan on global rank ``src`` and broadcast it to every rank of ``pg``.

    Planning is deterministic, so every rank could plan alone; broadcasting guarantees
    one plan even if ranks were given different inputs. Without an initialized process
    group this is just ``planner.plan(module, fixed=fixed)``. TorchRec spells it as a
    method: :meth:`EmbeddingShardingPlanner.collective_plan`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return planner.plan(module, fixed=fixed)
    box: list[ShardingPlan | Exception | None] = [None]
    if dist.get_rank() == src:
        try:
            box[0] = planner.plan(module, fixed=fixed)
        except (PlannerError, ValueError, KeyError) as e:  # every rank raises it, none waits in the broadcast
            box[0] = e
    dist.broadcast_object_list(box, src=src, group=pg)
    plan = box[0]
    if isinstance(plan, Exception):
        raise plan
    if not isinstance(plan, ShardingPlan):
        raise RuntimeError(
            f"collective_plan: rank {src} broadcast {type(plan).__name__}, not a ShardingPlan"
        )
    return plan
