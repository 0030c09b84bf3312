"""Shared features, sharded: one feature read by several tables (outputs ``feature@table``).

For every sharding type on 2 and 3 ranks, a sharded EmbeddingBagCollection and
EmbeddingCollection whose feature ``f0`` feeds two tables train exactly like the
unsharded module on the global batch, and the EBC's gathered checkpoint loads back
into the unsharded module (tables are keyed by table, not by feature).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _plans import GLOBAL_BATCH, TOL, assert_matches_unsharded, kjt_of, plan_of, random_steps, splits
from torch import nn

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimConfig,
)
from lightning_shardrec.planner import ShardingPlan, ShardingType
from lightning_shardrec.testing import run_ranks

TYPES = [t.value for t in ShardingType]
# the shared feature's two tables in different groups (mechanisms)
MIXED = {"mixed": {"t_big": "row_wise", "t_small": "table_wise", "t_share": "column_wise"}}
ROWS = {"f0": 40, "f1": 40, "f2": 2}
SHAPES = {"t_big": (40, 8), "t_small": (2, 12), "t_share": (40, 12)}
KEYS = ["f0@t_big", "f1", "f2", "f0@t_share"]
LR = 0.1


def bag_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(40, 8, "t_big", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(2, 12, "t_small", feature_names=["f2"]),
        EmbeddingBagConfig(40, 12, "t_share", feature_names=["f0"]),
    ]


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(bag_tables(), is_weighted=True)
        self.top = nn.Linear(3 + 40, 1)

    def forward(self, dense, kjt):
        kt = self.ebc(kjt)
        assert kt.keys() == KEYS, kt.keys()
        pooled = kt.values()
        return self.top(torch.cat([dense, pooled], 1)).squeeze(1), pooled


class Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(40, 8, "t_big", feature_names=["f0", "f1"]),
                EmbeddingConfig(2, 12, "t_small", feature_names=["f2"]),
                EmbeddingConfig(40, 12, "t_share", feature_names=["f0"]),
            ]
        )

    def forward(self, kjt):
        return self.ec(kjt)


def seq_loss(out) -> torch.Tensor:
    return sum((jt.values().sin() * (i + 1)).sum() for i, jt in enumerate(out.values()))


def train_sharded(rank, world, kinds):
    from lightning_shardrec.checkpoint import gather_full_state
    from lightning_shardrec.distributed import DistributedModelParallel

    sizes = splits(world, uneven=True)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    results = []
    for kind in kinds:
        plan = plan_of(MIXED.get(kind) or dict.fromkeys(SHAPES, kind), SHAPES, world)
        optim = FusedOptimConfig(optimizer="adagrad", lr=LR, eps=1e-8)
        dmp = DistributedModelParallel(Rec(), plan=ShardingPlan({"ebc": plan}), embedding_optimizer=optim)
        dense_opt = torch.optim.Adagrad(list(dmp.dense_parameters()), lr=LR, eps=1e-8)
        first = None
        for bags, wts, dense, label in random_steps(5, True, ROWS, 2):
            logits, pooled = dmp(dense[lo:hi], kjt_of(bags, wts, lo, hi))
            first = pooled.detach().clone() if first is None else first
            dense_opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(logits, label[lo:hi], reduction="sum")
            (loss * world / GLOBAL_BATCH).backward()
            dense_opt.step()
        shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
        top = {k: v.detach().clone() for k, v in dmp.module.top.state_dict().items()}
        weights, _ = gather_full_state(dmp.sharded)
        seq = DistributedModelParallel(
            Seq(), plan=ShardingPlan({"ec": plan}), embedding_optimizer=FusedOptimConfig(optimizer="sgd", lr=LR)
        )
        dense = list(seq.dense_parameters())  # data-parallel tables
        seq_opt = torch.optim.SGD(dense, lr=LR) if dense else None
        seq_out = []
        for bags, _, _, _ in random_steps(6, False, ROWS, 2):
            out = seq(kjt_of(bags, None, lo, hi))
            seq_out.append({k: (jt.values().detach().clone(), jt.lengths().clone()) for k, jt in out.items()})
            if seq_opt is not None:
                seq_opt.zero_grad()
            (seq_loss(out) * world / GLOBAL_BATCH).backward()
            if seq_opt is not None:
                seq_opt.step()
        seq_shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in seq.local_shards().items()}
        results.append(((first, shards, top), weights, (seq_out, seq_shards)))
    return results


def check(kind, world, results) -> None:
    sizes = splits(world, uneven=True)
    model = Rec()
    opt = torch.optim.Adagrad(model.parameters(), lr=LR, eps=1e-8)
    steps = random_steps(5, True, ROWS, 2)
    assert_matches_unsharded(kind, model, opt, steps, sizes, [r[0] for r in results], tuple(SHAPES))
    # the gathered checkpoint: keyed by table, equal to the unsharded tables
    for weights in (r[1] for r in results):
        assert sorted(weights) == sorted(f"ebc.embedding_bags.{t}.weight" for t in SHAPES)
        fresh = Rec()
        fresh.load_state_dict({**fresh.state_dict(), **weights})
        for t in SHAPES:
            torch.testing.assert_close(fresh.ebc.embedding_bags[t].weight, model.ebc.embedding_bags[t].weight, **TOL)
    # sequence collection: rows per id and trained tables
    seq = Seq()
    sgd = torch.optim.SGD(seq.parameters(), lr=LR)
    want = []
    for bags, _, _, _ in random_steps(6, False, ROWS, 2):
        out = seq(kjt_of(bags, None, 0, GLOBAL_BATCH))
        assert list(out) == KEYS
        want.append({k: (jt.values().detach(), jt.lengths()) for k, jt in out.items()})
        sgd.zero_grad()
        (seq_loss(out) / GLOBAL_BATCH).backward()
        sgd.step()
    lo = 0
    for rank, r in enumerate(results):
        seq_out, _ = r[2]
        hi = lo + sizes[rank]
        for step, (got, exp) in enumerate(zip(seq_out, want, strict=True)):
            assert list(got) == KEYS
            for k in KEYS:
                rows, lengths = exp[k]
                start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
                torch.testing.assert_close(got[k][1], lengths[lo:hi])
                torch.testing.assert_close(got[k][0], rows[start:end], **TOL, msg=f"{kind} rank {rank} step {step} {k}")
        lo = hi
    for t in SHAPES:
        ref = seq.ec.embeddings[t].weight.detach()
        got = torch.full_like(ref, float("nan"))
        for r in results:
            for (r0, c0), w in r[2][1].get(f"ec.embeddings.{t}.weight", []):
                got[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
        torch.testing.assert_close(got, ref, **TOL, msg=f"{kind} sequence table {t}")


@pytest.mark.parametrize("world", [2, 3])
def test_shared_feature_every_sharding_type_matches_unsharded(world):
    kinds = [*TYPES, *MIXED]
    per_rank = run_ranks(train_sharded, world, kinds)
    for i, kind in enumerate(kinds):
        check(kind, world, [r[i] for r in per_rank])
