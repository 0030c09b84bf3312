"""The model, plans and timed steps ``benchmarks/calibrate.py`` checks the cost model with.

Every plan is built once per rank; then ``rounds`` rounds run the plans interleaved
(A B C ... A B C ...), each ``steps`` timed steps after one untimed one, a barrier before
every step. A step's time is the slowest rank's; a plan's figure is the median over its rounds
of the round's median step, and its spread the range of the round medians. Before the rounds,
one step per plan runs under :class:`~_comm_count.CommCounter` (collective calls and bytes).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _comm_count import CommCounter, Tally
from harness import rounds

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


def shards(kind: str, pieces: list[tuple[int, int, int, int, int]]) -> ParameterSharding:
    """A fused ``kind`` sharding of ``pieces`` ``(rank, row0, col0, rows, cols)``."""
    shards = [ShardMetadata((r0, c0), (rows, cols), rank) for rank, r0, c0, rows, cols in pieces]
    return ParameterSharding(kind, "fused", [s.rank for s in shards], shards)


def blocks(rows: int, ranks: list[int], col0: int, cols: int) -> list[tuple[int, int, int, int, int]]:
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
            out[t] = shards("column_wise", [(r, 0, 16 * j, n, 16) for j, r in enumerate(ranks)])
        elif name == "table_row_wise" or (name == "grid_shard" and d < 64):  # row blocks over one host
            out[t] = shards("table_row_wise", blocks(n, host, 0, d))
        elif name == "grid_shard":  # two column halves, each row-blocked over one host
            out[t] = shards("grid_shard", blocks(n, HOSTS[0], 0, d // 2) + blocks(n, HOSTS[1], d // 2, d // 2))
        elif name == "mixed":  # the large tables row-wise, the middle ones whole, the small replicated
            if n >= 50_000:
                out[t] = shards("row_wise", blocks(n, list(range(WORLD)), 0, d))
            elif n >= 5_000:
                out[t] = shards("table_wise", [(i % WORLD, 0, 0, n, d)])
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


def model(tables: dict[str, tuple[int, int]] = TABLES, device: str | None = None) -> torch.nn.Module:
    """The checked model (``device="meta"``: for planning, nothing allocated)."""

    class Rec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=[f"f_{t}"])
                    for t, (n, d) in tables.items()
                ],
                device=device,
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
        return planner.plan(model(device="meta"), fixed=layout)
    return planner.plan(model(device="meta"), fixed=_layout(name) if PLANS[name] == "layout" else None)


def plan_layout(
    tables: dict[str, tuple[int, int]], fixed: dict[str, ParameterSharding], topo: Topology | None = None
) -> ShardingPlan:
    """``tables`` (name -> (rows, dim)) laid out as ``fixed`` says, priced for ``topo``."""
    topo = topo or Topology(WORLD, compute_device="cpu", local_world_size=LOCAL)
    pooled = {t: ParameterConstraints(pooling_factors=[float(POOLING)]) for t in tables}
    planner = EmbeddingShardingPlanner(topo, batch_size=BATCH, constraints=pooled)
    return planner.plan(model(tables, "meta"), fixed=fixed)


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

    return rounds(fn, reps, before=dist.barrier)


def check_rank(
    rank: int, world: int, names: list[str], rates: Rates | None, steps: int, rounds: int
) -> tuple[dict[str, dict[str, Tally]], dict[str, list[list[float]]]]:
    """Per plan: this rank's counted collectives of one step, and its step seconds per round (and the
    probes' steps (``_calibrate_probes.PROBES``), in the same rounds)."""
    from _calibrate_probes import PROBES, probe_plan

    with local_world_size(LOCAL):
        counters = {n: CommCounter(LOCAL) for n in names}
        steps_of = {n: train_step(rank, TABLES, plan_for(n, rates), counters[n]) for n in names}
        for probe in PROBES:  # timed alike: the in-step rates under the load the rounds ran under
            steps_of[probe] = train_step(rank, *probe_plan(probe))
            steps_of[probe]()
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


def round_steps(per_rank: list[list[list[float]]]) -> list[float]:
    """``per_rank[rank][round][step]`` seconds -> per round, the median step (a step: the slowest rank's)."""
    return [
        statistics.median(max(steps) for steps in zip(*(r[i] for r in per_rank), strict=True))
        for i in range(len(per_rank[0]))
    ]


def summarize(per_rank: list[list[list[float]]]) -> Measured:
    """``per_rank[rank][round][step]`` seconds -> :class:`Measured` (the median round and the rounds' range)."""
    rounds = round_steps(per_rank)
    return Measured(statistics.median(rounds), min(rounds), max(rounds))
