"""What the strategy reports about its plan when it shards: the plan table, each host's
transport (printed by rank 0) and ``sharding_plan.json`` beside the checkpoints."""

from __future__ import annotations

import os

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_shardrec import _fbgemm as fbgemm
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.same_host import transport_report
from lightning_shardrec.lightning.training.deferred import deferral_line
from lightning_shardrec.planner import ShardingPlan
from lightning_shardrec.planner.machine.memory import peak_line


@rank_zero_only
def print_plan(plan: ShardingPlan, kernels: dict[tuple[str, str], str], deferral: str | None) -> None:
    """The plan as a table (each table group's kernel), the fbgemm build and backend, the peak memory per
    rank and why updates wait."""
    peak = "" if plan.stats is None else "\n" + peak_line(plan.stats.max_storage, plan.stats.storage_cap)
    note = "" if deferral is None else "\n" + deferral_line(deferral)
    backend = f"\nkernels: {fbgemm.describe()}"
    print(f"lightning_shardrec sharding plan:\n{plan.table(kernels)}{backend}{peak}{note}", flush=True)


def print_transport(env: ShardingEnv) -> None:
    """Collective: rank 0 prints the hosts x ranks the plan assumed and each host's transport."""
    report = transport_report(env)
    if env.rank == 0:
        print(report, flush=True)


@rank_zero_only
def save_plan(plan: ShardingPlan | None, dirpath: str | None) -> None:
    """``sharding_plan.json`` beside the checkpoints (edit it and pass it back as ``plan=`` to pin it)."""
    if plan is None or not dirpath:
        return
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(dirpath, "sharding_plan.json"), "w") as f:
        f.write(plan.to_json())
