"""The calls the cost model derives from a plan (``step_calls``) are the calls a real step makes.

``benchmarks/calibrate.py check`` counts them for its plans; here the same counter runs one training
step per mechanism mix on 4 gloo ranks (2 pretend hosts x 2) and the model's count must match.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _calibrate_report import Row, as_calls, order_agreement  # noqa: E402
from _calibrate_runs import LOCAL, WORLD, Measured, plan_for  # noqa: E402
from _comm_count import Tally  # noqa: E402

from lightning_shardrec.planner.machine.rates import Calls, step_calls  # noqa: E402
from lightning_shardrec.testing import run_ranks  # noqa: E402

#: every mechanism at least once (mixed: table-wise, row-wise and replicated), and DDP with 2 buckets
NAMES = ["grid_shard", "mixed", "data_parallel"]


def counted_rank(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Tally]]:
    sys.path.insert(0, str(BENCH))
    from _calibrate_runs import train_step
    from _comm_count import CommCounter

    from lightning_shardrec.testing import local_world_size

    out = {}
    with local_world_size(LOCAL):
        for name in names:
            counter = CommCounter(LOCAL)
            step = train_step(rank, *_tables_and_plan(name), counter)
            step()
            with counter:
                step()
            out[name] = counter.tally()
    return out


def _tables_and_plan(name: str):  # type: ignore[no-untyped-def]
    from _calibrate_runs import TABLES

    return TABLES, plan_for(name, None)


def test_a_step_makes_the_calls_the_model_derives_from_its_plan() -> None:
    res = run_ranks(counted_rank, WORLD, NAMES, timeout=300)
    for name in NAMES:
        want = step_calls(plan_for(name, None), LOCAL)
        for rank, counted in enumerate(res):
            assert as_calls(counted[name]) == want, f"plan {name}, rank {rank}: counted {counted[name]}"
    # bytes: the in-host all-to-alls stay inside the host
    assert all(r["grid_shard"]["all_to_all@host"].inter == 0 < r["grid_shard"]["all_to_all@host"].intra for r in res)


def test_a_counted_kind_the_model_lacks_is_named() -> None:
    assert as_calls({"all_to_all@world": Tally(calls=3)}) == Calls(all_to_all=3)
    with pytest.raises(ValueError, match=r"counted collective 'broadcast@world' has no place in the cost model"):
        as_calls({"broadcast@world": Tally(calls=1)})


def test_order_is_claimed_only_where_the_measured_ranges_do_not_overlap() -> None:
    def row(name: str, est: float, lo: float, mid: float, hi: float, same: str | None = None) -> Row:
        return Row(name, est, Measured(mid, lo, hi), Calls(), Calls(), same)

    rows = [
        row("a", 1.0, 0.9, 1.0, 1.1),
        row("b", 3.0, 1.05, 1.2, 1.3),  # overlaps a: no order claimed
        row("c", 2.0, 2.0, 2.1, 2.2),  # clear of a and b; the estimate puts it below b: one disagreement
        row("d", 1.0, 0.9, 1.0, 1.1, same="a"),  # the same plan as a: never compared with it
    ]
    agree, clear, ties = order_agreement(rows)
    assert ties == [("a", "b"), ("b", "d")]
    assert (agree, clear) == (2, 3)  # clear pairs a-c, b-c, d-c; the estimate orders b-c the other way
