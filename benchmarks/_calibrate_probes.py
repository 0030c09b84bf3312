"""The probe steps ``benchmarks/calibrate.py`` times beside the plans, and the in-step rates fitted from them.

A probe is a step of small tables with a known layout (:data:`PROBES`). Probes that differ in one thing
(a mechanism, a table more, rows more) give what that thing costs inside a step. Every difference is
taken per round (the two probes ran next to each other, so the machine's drift between rounds cancels)
and the median over rounds is kept.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from _calibrate_runs import BATCH, HOSTS, LOCAL, POOLING, WORLD, blocks, plan_layout, round_steps, shards

from lightning_shardrec.planner import ParameterSharding, Rates, ShardingPlan, ShardMetadata, Topology
from lightning_shardrec.planner.costs.perf import distinct_rows
from lightning_shardrec.planner.machine.rates import critical_path

TINY = (4, 8)  # rows, dim of a tiny table: one row per rank row-wise, two per rank in a host

#: name -> (sharding type per table, rows, dim). ``base`` is the fixed step (``Rates.step_seconds``): one
#: tiny replicated table, no sharded group. Table-wise tables go round robin over the ranks, row-wise ones
#: over every rank, table_row_wise ones row-blocked in host 0.
PROBES: dict[str, tuple[list[str], int, int]] = {
    "base": (["data_parallel"], *TINY),
    "tw": (["table_wise"], *TINY),  # a group's 4 all-to-alls
    "rw": (["row_wise"], *TINY),  # 2 all-to-alls, a reduce-scatter and an all-gather
    "host": (["table_row_wise"], *TINY),  # 4 all-to-alls and 2 in-host ones
    "tw+rw": (["table_wise", "row_wise"], *TINY),  # two groups: what a further group costs
    "tw+host": (["table_wise", "table_row_wise"], *TINY),
    "tw x6": (["table_wise"] * 6, TINY[0], 64),  # what a further table costs in a plan
    "host x6": (["table_row_wise"] * 6, TINY[0], 64),  # what a further host piece adds
    "tw wide": (["table_wise"], TINY[0], 128),  # how much slower a step's all-to-alls move bytes than alone
    "tw x12": (["table_wise"] * 12, TINY[0], 64),  # three tables per rank ...
    "rows x12": (["table_wise"] * 12, 65_536, 64),  # ... of many rows, uniform ids: a distinct row's cost
    "rows16 x12": (["table_wise"] * 12, 65_536, 16),  # ... 16 wide: per row against per byte
    # two 26 MB replicated tables (two DDP buckets: one's all-reduce overlaps the other's backward)
    "dp large": (["data_parallel"] * 2, 100_000, 64),
}


def probe_plan(name: str, topo: Topology | None = None) -> tuple[dict[str, tuple[int, int]], ShardingPlan]:
    """Probe ``name``'s tables (name -> (rows, dim)) and their plan (priced for ``topo``)."""
    kinds, rows, dim = PROBES[name]
    tables = {f"t{i}": (rows, dim) for i in range(len(kinds))}
    fixed = {}
    for i, (t, kind) in enumerate(zip(tables, kinds, strict=True)):
        if kind == "data_parallel":
            fixed[t] = ParameterSharding(
                kind, "dense", range(WORLD), [ShardMetadata((0, 0), (rows, dim), r) for r in range(WORLD)]
            )
        elif kind == "table_wise":
            fixed[t] = shards(kind, [(i % WORLD, 0, 0, rows, dim)])
        elif kind == "row_wise":
            fixed[t] = shards(kind, blocks(rows, list(range(WORLD)), 0, dim))
        else:
            fixed[t] = shards(kind, blocks(rows, HOSTS[0], 0, dim))
    return tables, plan_layout(tables, fixed, topo)


def step_parts(rates: Rates, per_rank: list[dict[str, list[list[float]]]]) -> dict[str, float]:
    """The in-step rates, from the probes' steps ``per_rank[rank][probe][round][step]`` (seconds).

    Each probe is taken net of what the model already charges it (its critical path, without the distinct
    rows' term), so no byte is counted twice. First the rates: the all-to-all bandwidths slowed as a wide
    table's step shows, the replicated rates scaled to a large replicated table's step. Then, net of the
    critical path at those rates: the fixed step; by the calls
    :data:`~lightning_shardrec.planner.machine.rates.MECHANISM_CALLS` counts, the seconds per all-to-all (table-wise's
    4), per in-host all-to-all (table-row-wise's 2 more), per reduce-scatter or all-gather (row-wise's, beside
    its 2 all-to-alls); a further piece's and a further group's seconds; the seconds per byte of distinct
    distinct row and byte of it a lookup and update touch (twelve tables of many rows, 64 and 16 wide,
    against twelve of 4).
    """
    rounds = {name: round_steps([r[name] for r in per_rank]) for name in PROBES}

    def charges(at: Rates) -> dict[str, float]:
        topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=at)
        return {name: critical_path(probe_plan(name, topo)[1], at) for name in PROBES}

    def diff(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {name: x[name] - y[name] for name in PROBES}

    def gap(a: str, b: str, charged: dict[str, float]) -> float:
        """What ``a``'s step takes beyond ``b``'s and beyond what the model charges the difference."""
        paired = statistics.median(x - y for x, y in zip(rounds[a], rounds[b], strict=True))
        return paired - (charged[a] - charged[b])

    flat = replace(rates, row_seconds=0.0, row_byte_seconds=0.0)
    charged = charges(flat)
    # what the model charges the all-to-alls, and the replicated tables (the rise when their rates halve)
    a2a_part = diff(
        charges(replace(flat, intra_host_bw=rates.intra_host_bw / 2, inter_host_bw=rates.inter_host_bw / 2)), charged
    )
    dp_part = diff(charges(replace(flat, dense_bw=rates.dense_bw / 2, allreduce_bw=rates.allreduce_bw / 2)), charged)
    modeled = a2a_part["tw wide"] - a2a_part["tw"]
    slower = max(1.0, 1 + gap("tw wide", "tw", charged) / modeled)
    replicated = dp_part["dp large"] - dp_part["base"]
    scale = max(0.05, 1 + gap("dp large", "base", charged) / replicated)
    found = {
        "intra_host_bw": rates.intra_host_bw / slower,
        "inter_host_bw": rates.inter_host_bw / slower,
        "dense_bw": rates.dense_bw / scale,
        "allreduce_bw": rates.allreduce_bw / scale,
    }
    charged = charges(replace(flat, **found))

    def d(a: str, b: str) -> float:
        return gap(a, b, charged)

    # table-wise beyond the base (replicated only): the packed ids' all-to-all, the output's and its gradient's
    a2a = max(0.0, d("tw", "base") / 3)
    table = max(0.0, d("tw x12", "tw") / 11)
    # two mechanisms against each alone: a further group and a further piece (``table``), less the packed ids'
    # all-to-all the second mechanism shares with the first
    pair = statistics.fmean([d("tw+rw", "tw") - d("rw", "base"), d("tw+host", "tw") - d("host", "base")]) - table + a2a
    # per rank: three tables of 65,536 rows, each with the global batch's ids; a row's weights and adagrad
    # state, 64 or 16 wide
    touched = 3 * distinct_rows(BATCH * WORLD * POOLING, PROBES["rows x12"][1])
    wide, narrow = d("rows x12", "tw x12") / touched, d("rows16 x12", "tw x12") / touched
    per_byte = max(0.0, (wide - narrow) / ((64 - 16) * 4 * 2))
    return found | {
        "step_seconds": statistics.median(rounds["base"]) - charged["base"],
        "collective_seconds": a2a,
        "host_call_seconds": max(0.0, d("host", "tw") / 2),  # its 4 all-to-alls are table-wise's
        "reduce_scatter_seconds": max(0.0, (d("rw", "base") - a2a) / 2),  # beyond its packed ids
        "group_seconds": max(0.0, pair),
        "table_seconds": table,
        "host_table_seconds": max(0.0, (d("host x6", "tw x6") - d("host", "tw")) / 5),
        "row_seconds": max(0.0, narrow - 16 * 4 * 2 * per_byte),
        "row_byte_seconds": per_byte,
    }
