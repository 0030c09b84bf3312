"""Exactness: sharded training on W ranks == unsharded training on the global batch.

For every sharding type x {sum, mean} x {weighted, unweighted} x W in {1, 2, 3, 4},
with sgd and adagrad: forward outputs equal, and every weight (tables and dense)
equal after 3 steps. Tolerance: float32, only the summation order differs
(rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _plans import GLOBAL_BATCH, assert_matches_unsharded, kjt_of, plan_of, random_steps, splits
from torch import nn

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimConfig,
    PoolingType,
)
from lightning_shardrec.planner import (
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from lightning_shardrec.testing import run_ranks

TYPES = [t.value for t in ShardingType]
# A mixed plan: a grid table and a row-wise table share one mechanism (one group).
MIXED = {"grid_and_rows": {"t_big": "grid_shard", "t_small": "row_wise"}}
STEPS = 3
LR = 0.1
FEATURES = ["f0", "f1", "f2"]
ROWS = {"f0": 40, "f1": 40, "f2": 2}  # t_big is shared by f0 and f1; t_small has fewer rows than ranks


class Rec(nn.Module):
    def __init__(self, pooling: PoolingType, weighted: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=40, embedding_dim=8, name="t_big", feature_names=["f0", "f1"], pooling=pooling
                ),
                EmbeddingBagConfig(
                    num_embeddings=2, embedding_dim=12, name="t_small", feature_names=["f2"], pooling=pooling
                ),
            ],
            is_weighted=weighted,
        )
        self.top = nn.Linear(3 + 28, 1)

    def forward(self, dense, kjt):
        pooled = self.ebc(kjt).values()
        return self.top(torch.cat([dense, pooled], 1)).squeeze(1), pooled


def make_data(seed: int, weighted: bool) -> list[tuple]:
    return random_steps(seed, weighted, ROWS, STEPS)










def plan_for(kind: str, world: int) -> dict[str, ParameterSharding]:
    """Every table with sharding type ``kind`` (or the types of a ``MIXED`` plan)."""
    shapes = {"t_big": (40, 8), "t_small": (2, 12)}
    return plan_of(MIXED.get(kind) or {name: kind for name in shapes}, shapes, world)


def loss_fn(logits, label, world):
    # sum * W / G: DDP averages over ranks, so this makes every rank's share exact even when batches differ
    return F.binary_cross_entropy_with_logits(logits, label, reduction="sum") * world / GLOBAL_BATCH


def make_optimizers(params, name):
    return torch.optim.SGD(params, lr=LR) if name == "sgd" else torch.optim.Adagrad(params, lr=LR, eps=1e-8)


def train_sharded(rank, world, cases, kernel="auto"):
    from lightning_shardrec.distributed import DistributedModelParallel

    results = []
    for kind, pooling, weighted, optim, uneven, seed in cases:
        model = Rec(PoolingType(pooling), weighted)
        dmp = DistributedModelParallel(
            model,
            plan=ShardingPlan({"ebc": plan_for(kind, world)}),
            embedding_optimizer=FusedOptimConfig(optimizer=optim, lr=LR, eps=1e-8),
            kernel=kernel,
        )
        dense_opt = make_optimizers(list(dmp.dense_parameters()), optim)
        sizes = splits(world, uneven)
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        first = None
        for bags, wts, dense, label in make_data(seed, weighted):
            logits, pooled = dmp(dense[lo:hi], kjt_of(bags, wts, lo, hi))
            first = pooled.detach().clone() if first is None else first
            dense_opt.zero_grad()
            loss_fn(logits, label[lo:hi], world).backward()
            dense_opt.step()
        shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
        top = {k: v.detach().clone() for k, v in dmp.module.top.state_dict().items()}
        results.append((first, shards, top))
    return results


def check(case, world, results):
    kind, pooling, weighted, optim, uneven, seed = case
    model = Rec(PoolingType(pooling), weighted)
    opt = make_optimizers(model.parameters(), optim)
    steps = make_data(seed, weighted)
    assert_matches_unsharded(case, model, opt, steps, splits(world, uneven), results, ("t_big", "t_small"))


def matrix(optim):
    return [
        (kind, pooling, weighted, optim, False, 7)
        for kind in [*TYPES, *MIXED]
        for pooling in ("SUM", "MEAN")
        for weighted in (False, True)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["sgd", "adagrad"])
def test_every_sharding_type_matches_unsharded(world, optim):
    cases = matrix(optim)
    per_rank = run_ranks(train_sharded, world, cases)
    for i, case in enumerate(cases):
        check(case, world, [r[i] for r in per_rank])


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_batches_and_empty_rank(world):
    cases = [(kind, "MEAN", True, "adagrad", True, 11) for kind in TYPES]
    per_rank = run_ranks(train_sharded, world, cases)
    for i, case in enumerate(cases):
        check(case, world, [r[i] for r in per_rank])


def test_portable_backend_matches_too():
    cases = [(kind, "SUM", True, "adagrad", False, 5) for kind in TYPES]
    per_rank = run_ranks(train_sharded, 2, cases, "torch")
    for i, case in enumerate(cases):
        check(case, 2, [r[i] for r in per_rank])
