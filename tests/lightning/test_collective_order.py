"""The order of collectives is the same on every rank, and every control flag travels on one gloo group.

Each rank records its collectives through a fit (``record_collectives``: every call through
``torch.distributed``'s functions, with its group, backend, devices and, where ranks must agree,
its size); the test compares the ranks' sequences call by call, for fits with the pipeline off
and on, with uneven per-rank data (padded steps) and with a dynamic table. The control messages
(the SIGTERM flag, the uneven-batches agreement, the after-fit decision) must all be on one group,
gloo with CPU tensors, that carries nothing else (docs/operations.md, "Collectives: groups and
their order").
"""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer
from test_strategy_dynamic import DynamicRec
from test_strategy_dynamic import data as dynamic_data
from test_uneven_batches import Batches, SumRec, rank_batches

from lightning_shardrec.distributed.comm.collective_log import Call, first_difference, record_collectives
from lightning_shardrec.testing import run_ranks

STEPS, BATCH = 6, 4
FIT_S = 600.0  # a fit of 2 ranks on 2 cores shared with other jobs (load 30 measured) outlasts the 180 s default
CONTROL = ("lightning/failures/sigterm.py", "lightning/training/uneven.py", "lightning/checkpoints/after_fit.py")
KINDS = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "data_parallel"}


def _strategy(case: str):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    if case == "dynamic":
        return ShardRecStrategy(constraints={"t_user": ParameterConstraints(sharding_types=["row_wise"])})
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in KINDS.items()}
    return ShardRecStrategy(
        constraints=constraints, pipeline=case == "pipeline", full_tables_after_fit=case == "static"
    )


def fit_recorded(rank: int, world: int, case: str) -> list[Call]:
    external_launch(rank, world)
    t = trainer(strategy=_strategy(case), devices=world, max_steps=STEPS)
    with record_collectives() as log:
        if case == "uneven":
            batches = rank_batches([3, 1] if world == 2 else [3, 1, 2])
            t.fit(SumRec(BATCH), torch.utils.data.DataLoader(Batches(batches[rank]), batch_size=None))
        elif case == "dynamic":
            t.fit(DynamicRec(), dynamic_data(BATCH))
        else:
            t.fit(Rec(), data(BATCH, STEPS))
    return log.calls


@pytest.mark.parametrize("case", ["static", "pipeline", "uneven", "dynamic"])
def test_every_rank_issues_the_same_collectives_in_the_same_order(case: str) -> None:
    sequences = run_ranks(fit_recorded, 2, case, timeout=FIT_S)
    assert first_difference(sequences) is None, first_difference(sequences)
    for rank, calls in enumerate(sequences):
        data_path = [c for c in calls if c.caller.startswith("lightning_shardrec/distributed/") and c.op != "new_group"]
        assert data_path, f"rank {rank}: no collective of the tables recorded"
        control = [c for c in calls if c.caller.endswith(CONTROL)]
        assert control, f"rank {rank}: no control message recorded"
        groups = {c.group for c in control}
        assert len(groups) == 1, f"rank {rank}: control messages on groups {sorted(groups)}: " + "; ".join(
            map(str, control)
        )
        (group,) = groups
        bad = [c for c in control if c.backend != "gloo" or c.devices != ("cpu",)]
        assert not bad, f"rank {rank}: control messages not on a gloo group with CPU tensors: {bad}"
        others = [c for c in calls if c.group == group and c.op != "new_group" and not c.caller.endswith(CONTROL)]
        assert not others, f"rank {rank}: the control group carries other collectives: " + "; ".join(map(str, others))
    if case == "uneven":  # a next() agreement per step: 3 steps and the end of the epoch
        uneven = "lightning/training/uneven.py"
        assert sum(c.caller.endswith(uneven) and c.op == "all_reduce" for c in sequences[0]) >= 4
    if case == "static":  # the after-fit decision joined the SIGTERM flag on the control group
        assert any(c.caller.endswith("lightning/checkpoints/after_fit.py") for c in sequences[0])


def _swapped(rank: int, world: int) -> list[Call]:
    import torch.distributed as dist

    a, b = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    with record_collectives() as log:
        x, y = torch.ones(2), torch.ones(3)
        order = [(x, a), (y, b)] if rank == 0 else [(y, b), (x, a)]
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in order]
        for w in works:
            w.wait()
    dist.destroy_process_group(a)
    dist.destroy_process_group(b)
    return log.calls


def test_first_difference_names_the_call_where_the_ranks_part() -> None:
    sequences = run_ranks(_swapped, 2)
    diff = first_difference(sequences)
    assert diff is not None and diff.startswith("collective 0: rank 0 issued all_reduce on group"), diff
    assert "(gloo, cpu 2 elements)" in diff and "(gloo, cpu 3 elements)" in diff


def test_recording_does_not_nest() -> None:
    with (
        record_collectives(),
        pytest.raises(RuntimeError, match="already recording in this process"),
        record_collectives(),
    ):
        pass
