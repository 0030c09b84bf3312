"""The model, plans and timed steps ``benchmarks/calibrate.py`` checks the cost model with.

Every plan is built once per rank; then ``rounds`` rounds run the plans interleaved
(A B C ... A B C ...), each ``steps`` timed steps after one untimed one, a barrier before
every step. A step's time is the slowest rank's; a plan's figure is the median over its rounds
of the round's median step, and its spread the range of the round medians. Before the rounds,
one step per plan runs under :class:`~_comm_count.CommCounter` (collective calls and bytes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _comm_count import CommCounter, Tally

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    Rates,
    ShardingPlan,
    ShardMetadata,
    Topology,
)
from lightning_shardrec.planner.rates import critical_path
from lightning_shardrec.testing import local_world_size

WORLD, LOCAL = 4, 2
BATCH = 256  # per rank
POOLING = 4
# name: (rows, dim)
TABLES = {
    "t0": (100_000, 64),
    "t1": (50_000, 64),
    "t2": (20_000, 32),
    "t3": (5_000, 32),
    "t4": (1_000, 16),
    "t5": (200, 16),
}
HOSTS = [[0, 1], [2, 3]]


def _shards(kind: str, pieces: list[tuple[int, int, int, int, int]]) -> ParameterSharding:
    """A fused ``kind`` sharding of ``pieces`` ``(rank, row0, col0, rows, cols)``."""
    shards = [ShardMetadata((r0, c0), (rows, cols), rank) for rank, r0, c0, rows, cols in pieces]
    return ParameterSharding(kind, "fused", [s.rank for s in shards], shards)


def _blocks(rows: int, ranks: list[int], col0: int, cols: int) -> list[tuple[int, int, int, int, int]]:
    """Row blocks of ``rows`` (near-equal) over ``ranks``, columns ``[col0, col0 + cols)``."""
    cuts = [rows * i // len(ranks) for i in range(len(ranks) + 1)]
    return [(r, cuts[i], col0, cuts[i + 1] - cuts[i], cols) for i, r in enumerate(ranks)]


def _layout(name: str) -> dict[str, ParameterSharding]:
    """The hand-made layouts: table -> sharding (2 hosts x 2 ranks, tables alternate hosts)."""
    out = {}
    for i, (t, (n, d)) in enumerate(TABLES.items()):
        host = HOSTS[i % 2]
        if name == "column_wise":  # 16-wide pieces over the ranks, 16-wide tables whole
            k = d // 16
            ranks = [(i + j) % WORLD for j in range(k)]
            out[t] = _shards("column_wise", [(r, 0, 16 * j, n, 16) for j, r in enumerate(ranks)])
        elif name == "table_row_wise" or (name == "grid_shard" and d < 64):  # row blocks over one host
            out[t] = _shards("table_row_wise", _blocks(n, host, 0, d))
        elif name == "grid_shard":  # two column halves, each row-blocked over one host
            out[t] = _shards("grid_shard", _blocks(n, HOSTS[0], 0, d // 2) + _blocks(n, HOSTS[1], d // 2, d // 2))
        elif name == "mixed":  # the large tables row-wise, the middle ones whole, the small replicated
            if n >= 50_000:
                out[t] = _shards("row_wise", _blocks(n, list(range(WORLD)), 0, d))
            elif n >= 5_000:
                out[t] = _shards("table_wise", [(i % WORLD, 0, 0, n, d)])
    return out


#: plan name -> how it is made: sharding types for the planner (None: its choice), or a hand-made layout
PLANS: dict[str, list[str] | None | str] = {
    "table_wise": ["table_wise"],
    "column_wise": "layout",
    "row_wise": ["row_wise"],
    "table_row_wise": "layout",
    "grid_shard": "layout",
    "mixed": "layout",  # + the small tables data_parallel
    "data_parallel": ["data_parallel"],
    "planner": None,
}


def model(tables: dict[str, tuple[int, int]] = TABLES) -> torch.nn.Module:
    class Rec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=[f"f_{t}"])
                    for t, (n, d) in tables.items()
                ]
            )
            self.top = torch.nn.Linear(sum(d for _, d in tables.values()), 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.top(self.ebc(kjt).values()).squeeze(1)

    return Rec()


def constraints(name: str) -> dict[str, ParameterConstraints]:
    kinds = PLANS[name]
    if name == "mixed":
        kinds = ["data_parallel"]
    return {
        t: ParameterConstraints(
            sharding_types=kinds if isinstance(kinds, list) else None,
            compute_kernels=["dense"] if kinds == ["data_parallel"] else None,
            pooling_factors=[float(POOLING)],
        )
        for t in TABLES
    }


def plan_for(name: str, rates: Rates | None, layout: ShardingPlan | None = None) -> ShardingPlan:
    """Plan ``name`` for ``rates``; with ``layout``: that plan's layout, priced at ``rates``."""
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=rates)
    planner = EmbeddingShardingPlanner(topo, batch_size=BATCH, constraints=constraints(name))
    if layout is not None:
        return planner.plan(model(), fixed=layout)
    return planner.plan(model(), fixed=_layout(name) if PLANS[name] == "layout" else None)


TINY = (4, 8)  # rows, dim of a tiny table: one row per rank row-wise, two per rank in a host


def tiny_plan(
    kinds: list[str], topo: Topology | None = None, dim: int = TINY[1]
) -> tuple[dict[str, tuple[int, int]], ShardingPlan]:
    """One tiny table (``dim`` wide) per entry of ``kinds`` (data_parallel, table_wise round robin, row_wise
    over every rank, table_row_wise over host 0) and their plan: the steps that measure a group's costs."""
    rows = TINY[0]
    tiny = {f"t{i}": (rows, dim) for i in range(len(kinds))}
    fixed = {}
    for i, (t, kind) in enumerate(zip(tiny, kinds, strict=True)):
        if kind == "data_parallel":
            fixed[t] = ParameterSharding(
                kind, "dense", range(WORLD), [ShardMetadata((0, 0), (rows, dim), r) for r in range(WORLD)]
            )
        elif kind == "table_wise":
            fixed[t] = _shards(kind, [(i % WORLD, 0, 0, rows, dim)])  # round robin, as plans spread tables
        elif kind == "row_wise":
            fixed[t] = _shards(kind, _blocks(rows, list(range(WORLD)), 0, dim))
        else:
            fixed[t] = _shards(kind, _blocks(rows, HOSTS[0], 0, dim))
    topo = topo or Topology(WORLD, compute_device="cpu", local_world_size=LOCAL)
    pooled = {t: ParameterConstraints(pooling_factors=[float(POOLING)]) for t in tiny}
    return tiny, EmbeddingShardingPlanner(topo, batch_size=BATCH, constraints=pooled).plan(model(tiny), fixed=fixed)


#: the tiny-table steps that measure the fixed step, what each kind of call costs inside a step, what a
#: further sharding group and a further table cost (:func:`step_parts`); ``base`` is the fixed step's model
#: (``Rates.step_seconds``): one tiny replicated table, no sharded group
PARTS: dict[str, list[str]] = {
    "base": ["data_parallel"],
    "tw": ["table_wise"],
    "rw": ["row_wise"],
    "host": ["table_row_wise"],
    "tw+rw": ["table_wise", "row_wise"],
    "tw+host": ["table_wise", "table_row_wise"],
    "tw x6": ["table_wise"] * 6,  # 64 wide, round robin over the ranks: what a further table costs in a plan
    "host x6": ["table_row_wise"] * 6,  # 64 wide, row-blocked in host 0: what a further host piece adds
    "tw wide": ["table_wise"],  # 128 wide: how much slower a step's all-to-alls move bytes than alone
}
#: the tiny tables' width where it is not ``TINY``'s
WIDTH = {"tw x6": 64, "host x6": 64, "tw wide": 128}


def part_plan(name: str, topo: Topology | None = None) -> tuple[dict[str, tuple[int, int]], ShardingPlan]:
    return tiny_plan(PARTS[name], topo, WIDTH.get(name, TINY[1]))


def step_parts(rates: Rates, per_rank: list[dict[str, list[list[float]]]]) -> dict[str, float]:
    """The fixed step (a tiny replicated table: dense model, header, DDP's all-reduce) and, by the calls
    :data:`~lightning_shardrec.planner.rates.MECHANISM_CALLS` counts, the in-step seconds per all-to-all
    (table-wise's 4), per in-host all-to-all (table-row-wise's 2 more), per reduce-scatter or all-gather
    (row-wise's, beside its 2 all-to-alls); a further group's and a further table's seconds; the all-to-all
    bandwidths slowed as a wide tiny table's step shows.

    ``per_rank[rank][part][round][step]``: the :data:`PARTS` steps' seconds. Each tiny step is taken net
    of what the model already charges it (``rates``' bandwidths and kernel: the plan's critical path), so
    its bytes are not counted twice."""
    topo = Topology(WORLD, compute_device="cpu", local_world_size=LOCAL, rates=rates)
    charged = {name: critical_path(part_plan(name, topo)[1], rates) for name in PARTS}
    t = {name: summarize([r[name] for r in per_rank]).seconds - charged[name] for name in PARTS}
    # a 128-wide table's all-to-alls against an 8-wide one's: how much slower bytes move in a step than alone
    modeled = charged["tw wide"] - charged["tw"]
    slower = max(1.0, (t["tw wide"] - t["tw"] + modeled) / modeled)
    a2a = max(0.0, (t["tw"] - t["base"]) / 4)
    pair = statistics.fmean(
        [t["tw+rw"] - t["tw"] - t["rw"] + t["base"], t["tw+host"] - t["tw"] - t["host"] + t["base"]]
    )
    return {
        "step_seconds": t["base"],
        "collective_seconds": a2a,
        "host_call_seconds": max(0.0, (t["host"] - t["base"] - 4 * a2a) / 2),
        "reduce_scatter_seconds": max(0.0, (t["rw"] - t["base"] - 2 * a2a) / 2),
        "group_seconds": max(0.0, pair),
        "table_seconds": max(0.0, (t["tw x6"] - t["tw"]) / 5),
        "host_table_seconds": max(0.0, (t["host x6"] - t["host"] - t["tw x6"] + t["tw"]) / 5),
        "intra_host_bw": rates.intra_host_bw / slower,
        "inter_host_bw": rates.inter_host_bw / slower,
    }


def batch(seed: int, tables: dict[str, tuple[int, int]] = TABLES) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = [f"f_{t}" for t in tables]
    values = torch.cat([torch.randint(0, n, (BATCH * POOLING,), generator=g) for n, _ in tables.values()])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.full((len(keys) * BATCH,), POOLING))


def train_step(
    rank: int, tables: dict[str, tuple[int, int]], plan, counter: CommCounter | None = None
) -> Callable[[], None]:  # type: ignore[no-untyped-def]
    """One training step of ``model(tables)`` under ``plan``: fused adagrad tables, adagrad dense part."""
    import torch.nn.functional as F

    from lightning_shardrec.distributed import DistributedModelParallel

    dmp = DistributedModelParallel(
        model(tables), plan=plan, embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=0.01)
    )
    if counter is not None and isinstance(dmp._dmp_wrapped_module, torch.nn.parallel.DistributedDataParallel):
        counter.hook_ddp(dmp._dmp_wrapped_module)
    dense = torch.optim.Adagrad(list(dmp.dense_parameters()), lr=0.01)
    kjt, label = batch(rank, tables), torch.rand(BATCH)

    def step() -> None:
        loss = F.binary_cross_entropy_with_logits(dmp(kjt), label)
        dense.zero_grad()
        loss.backward()
        dense.step()

    return step


def timed(fn: Callable[[], None], reps: int) -> list[float]:
    """Seconds of ``reps`` calls of ``fn``, each after a barrier (every rank starts together)."""
    import torch.distributed as dist

    out = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def check_rank(
    rank: int, world: int, names: list[str], rates: Rates | None, steps: int, rounds: int
) -> tuple[dict[str, dict[str, Tally]], dict[str, list[list[float]]]]:
    """Per plan: this rank's counted collectives of one step, and its step seconds per round (and the
    :data:`PARTS` steps', in the same rounds)."""
    with local_world_size(LOCAL):
        counters = {n: CommCounter(LOCAL) for n in names}
        steps_of = {n: train_step(rank, TABLES, plan_for(n, rates), counters[n]) for n in names}
        for part in PARTS:  # timed alike: the in-step rates under the load the rounds ran under
            steps_of[part] = train_step(rank, *part_plan(part))
            steps_of[part]()
        for n in names:
            steps_of[n]()
            steps_of[n]()
            with counters[n]:
                steps_of[n]()
        times: dict[str, list[list[float]]] = {n: [] for n in steps_of}
        for _ in range(rounds):
            for n in steps_of:
                steps_of[n]()
                times[n].append(timed(steps_of[n], steps))
        return {n: c.tally() for n, c in counters.items()}, times


@dataclass(frozen=True)
class Measured:
    """A plan's step: ``seconds`` (median over rounds of the slowest rank's median step) and its round range."""

    seconds: float
    lo: float
    hi: float

    @property
    def spread(self) -> float:
        """The round medians' range as a share of the figure."""
        return (self.hi - self.lo) / self.seconds


def summarize(per_rank: list[list[list[float]]]) -> Measured:
    """``per_rank[rank][round][step]`` seconds -> :class:`Measured` (the slowest rank per step)."""
    rounds = [
        statistics.median(max(steps) for steps in zip(*(r[i] for r in per_rank), strict=True))
        for i in range(len(per_rank[0]))
    ]
    return Measured(statistics.median(rounds), min(rounds), max(rounds))
