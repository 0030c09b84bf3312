"""Exactness of the holders-only output of table-row-wise and grid tables.

Several hosts are simulated on one machine (``LOCAL_WORLD_SIZE``): W=4 as 2 hosts of
2 ranks and as 4 hosts of 1, besides one host of W=2, 3, 4. For plans whose blocks
sit inside hosts, plans mixing every row-block type with table-wise, plans where most
ranks hold no table-row-wise block, pieces held by some ranks of a host (several
pieces of one host with different holder sets, single-holder pieces), and hand-written
plans whose blocks span hosts, also with a rank that has no samples:
forward outputs and every weight after 3 steps equal unsharded training on the global
batch (sum/mean, weighted, sgd/adagrad; rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _plans import GLOBAL_BATCH, assert_matches_unsharded, kjt_of, random_steps
from torch import nn

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.testing import local_world_size, run_ranks

STEPS = 3
LR = 0.1
# name: (rows, dim, features); t_c has fewer rows than some hosts have ranks
TABLES = {"t_a": (40, 8, ["f0", "f1"]), "t_b": (30, 12, ["f2"]), "t_c": (3, 4, ["f3"]), "t_d": (10, 8, ["f4"])}
FEATURES = [f for _, _, fs in TABLES.values() for f in fs]
ROWS = {f: rows for rows, _, fs in TABLES.values() for f in fs}
CUTS = {8: [(0, 4), (4, 4)], 12: [(0, 8), (8, 4)], 4: [(0, 4)]}
TW, RW, TWRW, GRID = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.GRID_SHARD,
)
PLANS = ["host", "grid", "mixed", "idle", "span", "subset"]


class Rec(nn.Module):
    def __init__(self, pooling: PoolingType, weighted: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        configs = [
            EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=fs, pooling=pooling)
            for t, (n, d, fs) in TABLES.items()
        ]
        self.ebc = EmbeddingBagCollection(configs, is_weighted=weighted)
        self.top = nn.Linear(3 + sum(d * len(fs) for _, d, fs in TABLES.values()), 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(kjt).values()
        return self.top(torch.cat([dense, pooled], 1)).squeeze(1), pooled


def blocks(rows: int, ranks: list[int], col: tuple[int, int] = (0, 0)) -> list[ShardMetadata]:
    """Uneven row blocks of columns ``col = (start, width)`` (width 0: all) on ``ranks`` in turn."""
    n = min(len(ranks), rows)
    bounds = [0] + sorted({max(1, rows * (k + 1) // (n + 1) + k) for k in range(n - 1)}) + [rows]
    c0, width = col
    return [
        ShardMetadata((a, c0), (b - a, width), ranks[k])
        for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
    ]


def plan_for(kind: str, world: int, local: int) -> dict[str, ParameterSharding]:
    """Plans named in ``PLANS`` for ``world`` ranks, ``local`` per host."""
    hosts = world // local
    host = [list(range(h * local, (h + 1) * local)) for h in range(hosts)]
    everyone = list(range(world))

    def grid(name: str, first_host: int, ranks_of=lambda p: []) -> tuple[ShardingType, list[ShardMetadata]]:
        rows, dim, _ = TABLES[name]
        return GRID, [
            s
            for p, (c, w) in enumerate(CUTS[dim])
            for s in blocks(rows, ranks_of(p) or host[(first_host + p) % hosts][::-1], (c, w))
        ]

    def whole(st: ShardingType, name: str, ranks: list[int]) -> tuple[ShardingType, list[ShardMetadata]]:
        rows, dim, _ = TABLES[name]
        return st, [
            ShardMetadata((s.shard_offsets[0], 0), (s.shard_sizes[0], dim), s.rank) for s in blocks(rows, ranks)
        ]

    if kind == "host":  # every table row-blocked inside one host
        types = {
            "t_a": whole(TWRW, "t_a", host[0]),
            "t_b": whole(TWRW, "t_b", host[-1][::-1]),
            "t_c": whole(TWRW, "t_c", host[1 % hosts]),
            "t_d": whole(TWRW, "t_d", host[0][:1]),
        }
    elif kind == "grid":  # pieces of one table on different hosts
        types = {
            "t_a": grid("t_a", 0),
            "t_b": grid("t_b", 1),
            "t_c": whole(TWRW, "t_c", host[0]),
            "t_d": grid("t_d", 1),
        }
    elif kind == "mixed":  # row-wise + table-row-wise + grid + table-wise in one collection
        types = {
            "t_a": grid("t_a", 1),
            "t_b": whole(TWRW, "t_b", host[-1][:1]),
            "t_c": whole(RW, "t_c", everyone[::-1]),
            "t_d": whole(TW, "t_d", [world - 1]),
        }
    elif kind == "idle":  # only rank 0 holds table-row-wise blocks: its host-mates and other hosts none
        types = {
            "t_a": whole(TWRW, "t_a", [0]),
            "t_b": whole(TW, "t_b", [world - 1]),
            "t_c": whole(RW, "t_c", everyone),
            "t_d": whole(TWRW, "t_d", [0]),
        }
    elif kind == "span":  # hand-written: blocks of one table on several hosts (their sums are added)
        types = {
            "t_a": whole(TWRW, "t_a", everyone),
            "t_b": grid("t_b", 0, lambda p: [(p + k) % world for k in range(world)]),
            "t_c": whole(TWRW, "t_c", everyone[::-1]),
            "t_d": whole(TW, "t_d", [0]),
        }
    elif kind == "subset":  # pieces on some ranks of a host, holder sets differing, k = 1 among them

        def some(h: int, *idx: int) -> list[int]:
            return list(dict.fromkeys(host[h][i % local] for i in idx))

        picks = {"t_a": [some(0, 2, 3), some(0, 0)], "t_b": [some(0, 1, 2), some(-1, 3, 2, 1)]}
        types = {
            "t_a": grid("t_a", 0, lambda p: picks["t_a"][p]),
            "t_b": grid("t_b", 0, lambda p: picks["t_b"][p]),
            "t_c": whole(TWRW, "t_c", some(1 % hosts, 1)),
            "t_d": whole(TWRW, "t_d", some(-1, 0, 1, 3)[-2:]),
        }
    else:
        raise KeyError(f"unknown plan {kind!r}; available: {PLANS}")
    return {
        name: ParameterSharding(st, EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards)
        for name, (st, shards) in types.items()
    }


def make_data(seed: int, weighted: bool) -> list[tuple]:
    return random_steps(seed, weighted, ROWS, STEPS)


def splits(world: int, uneven: bool) -> list[int]:
    if uneven:  # rank 1 gets no samples
        sizes = [GLOBAL_BATCH // (world - 1)] * world
        sizes[1] = 0
    else:
        sizes = [GLOBAL_BATCH // world] * world
    sizes[-1] += GLOBAL_BATCH - sum(sizes)
    return sizes


def optimizer(params, name: str) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR) if name == "sgd" else torch.optim.Adagrad(params, lr=LR, eps=1e-8)


def train_sharded(rank: int, world: int, local: int, cases: list[tuple]) -> list[tuple]:
    from lightning_shardrec.distributed import DistributedModelParallel

    results = []
    for kind, pooling, weighted, optim, uneven, seed in cases:
        with local_world_size(local):
            dmp = DistributedModelParallel(
                Rec(PoolingType(pooling), weighted),
                plan=ShardingPlan({"ebc": plan_for(kind, world, local)}),
                embedding_optimizer=FusedOptimConfig(optimizer=optim, lr=LR, eps=1e-8),
            )
        dense_opt = optimizer(list(dmp.dense_parameters()), optim)
        sizes = splits(world, uneven)
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        first = None
        for bags, wts, dense, label in make_data(seed, weighted):
            logits, pooled = dmp(dense[lo:hi], kjt_of(bags, wts, lo, hi))
            first = pooled.detach().clone() if first is None else first
            dense_opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(logits, label[lo:hi], reduction="sum") * world / GLOBAL_BATCH
            loss.backward()
            dense_opt.step()
        shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
        top = {k: v.detach().clone() for k, v in dmp.module.top.state_dict().items()}
        results.append((first, shards, top))
    return results


def check(case: tuple, world: int, results: list[tuple]) -> None:
    kind, pooling, weighted, optim, uneven, seed = case
    model = Rec(PoolingType(pooling), weighted)
    opt = optimizer(model.parameters(), optim)
    assert_matches_unsharded(case, model, opt, make_data(seed, weighted), splits(world, uneven), results, TABLES)


VARIANTS = [("SUM", False, "sgd"), ("MEAN", True, "adagrad"), ("SUM", True, "adagrad"), ("MEAN", False, "sgd")]


@pytest.mark.parametrize(("world", "local"), [(2, 2), (3, 3), (4, 4), (4, 2), (4, 1)])
def test_host_reduction_matches_unsharded(world: int, local: int) -> None:
    several_hosts = local < world
    variants = VARIANTS if several_hosts else VARIANTS[:2]
    cases = [(kind, p, w, o, False, 3 + i) for kind in PLANS for i, (p, w, o) in enumerate(variants)]
    if (world, local) == (4, 2):  # a rank with no samples, on a host with two
        cases += [(kind, "MEAN", True, "adagrad", True, 9) for kind in PLANS]
    else:  # a rank with no samples, holding blocks of pieces with several holders
        cases += [("subset", "SUM", True, "sgd", True, 11)]
    per_rank = run_ranks(train_sharded, world, local, cases)
    for i, case in enumerate(cases):
        check(case, world, [r[i] for r in per_rank])


def layout_of(rank: int, world: int, local: int, kind: str) -> tuple[int, list[tuple[int, ...]], list[list[int]]]:
    """(kernel output width, every unit's holders, units shared with each rank of the host) of the group."""
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.sharding import HostRowBlockSharding

    with local_world_size(local):
        dmp = DistributedModelParallel(
            Rec(PoolingType.SUM, False), plan=ShardingPlan({"ebc": plan_for(kind, world, local)})
        )
    (group,) = [g for g in dmp.sharded["ebc"].groups if isinstance(g, HostRowBlockSharding)]
    return group.local_width, [u.holders for u in group.units], group.exchange.pairs


def test_only_holders_pool_and_exchange() -> None:
    # "subset" on 2 hosts of 2: t_a piece 0 (f0, f1: 4 + 4 cols) on {0, 1}, piece 1 on {0}; t_b piece 0
    # (8 cols) on {0, 1}, piece 1 (4) on {2, 3}; t_c (4) on {3}; t_d (8) on {2, 3}
    got = run_ranks(layout_of, 4, 2, "subset")
    holders = [(0, 1), (0,), (0, 1), (2, 3), (3,), (2, 3)]
    assert got == [
        (24, holders, [[], [0, 2]]),
        (16, holders, [[0, 2], []]),
        (12, holders, [[], [3, 5]]),
        (16, holders, [[3, 5], []]),
    ]
    # one host of 4: rank 0 holds only t_a piece 1 and shares no piece; ranks 1-3 share theirs
    got = run_ranks(layout_of, 4, 4, "subset")
    assert [g[1] for g in got][0] == [(2, 3), (0,), (1, 2), (1, 2, 3), (1,), (1, 3)]
    assert [g[2] for g in got] == [
        [[], [], [], []],
        [[], [], [2, 3], [3, 5]],
        [[], [2, 3], [], [0, 3]],
        [[], [3, 5], [0, 3], []],
    ]
    # "idle" on 4 hosts of 1: only rank 0 pools t_a (f0, f1) and t_d; the others send nothing
    assert [g[0] for g in run_ranks(layout_of, 4, 1, "idle")] == [24, 0, 0, 0]


def test_sharding_env_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_shardrec.distributed import ShardingEnv

    assert ShardingEnv(1, 4, None, 2).num_hosts == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ShardingEnv(0, 4).local_world_size == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # does not divide 4: one host, as Topology does
    assert ShardingEnv(0, 4).local_world_size == 4
    with pytest.raises(
        ValueError, match=r"local_world_size \(ranks per host\) must be a positive int dividing world_size 4, got 3"
    ):
        ShardingEnv(0, 4, None, 3)


def envs(rank: int, world: int, local: int) -> tuple[int, int]:
    from lightning_shardrec.distributed import ShardingEnv
    from lightning_shardrec.planner import Topology

    with local_world_size(local):
        return ShardingEnv.from_process_group().local_world_size, int(Topology.from_process_group().local_world_size)  # type: ignore[arg-type]


def test_runtime_and_planner_agree_on_hosts() -> None:
    assert run_ranks(envs, 2, 1) == [(1, 1), (1, 1)]
    assert run_ranks(envs, 2, None) == [(2, 2), (2, 2)]
