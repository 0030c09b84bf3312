"""VBE (variable batch per feature) through the sharded collections, every sharding type, 2 and 3 ranks.

Each rank sends its slice of the global batch as a VBE KJT: feature ``f0`` (the
"user") has one bag per pair of samples, ``inverse_indices`` maps samples to it;
``f1``/``f2`` have one bag per sample. The sharded EBC and EC must equal the unsharded
modules fed the global VBE batch: forward outputs of each rank's slice, and tables after
training (the EBC with a dense head, Adagrad; the EC with SGD). Pairs never straddle
ranks (every split is even), so the global batch's bags are the ranks' bags.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _plans import GLOBAL_BATCH, TOL, plan_of, random_steps, splits
from torch import nn

from lightning_shardrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from lightning_shardrec.planner import ShardingPlan, ShardingType
from lightning_shardrec.testing import run_ranks

TYPES = [t.value for t in ShardingType]
FEATURES = ["f0", "f1", "f2"]
ROWS = {"f0": 40, "f1": 40, "f2": 2}
SHAPES = {"t_big": (40, 8), "t_small": (2, 12), "t_user": (40, 12)}
KEYS = ["f0@t_big", "f1", "f2", "f0@t_user"]
LR = 0.1
STEPS = 2


def vbe_kjt_of(bags: dict, wts: dict | None, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` as a VBE KJT: ``f0`` keeps the bag of each pair's first sample (one per pair)."""
    firsts = {f: list(range(lo, hi)) for f in FEATURES}
    firsts["f0"] = sorted({b - b % 2 for b in range(lo, hi)})
    inverse = torch.tensor(
        [[firsts[f].index(b - b % 2 if f == "f0" else b) for b in range(lo, hi)] for f in FEATURES], dtype=torch.long
    ).view(len(FEATURES), hi - lo)
    lengths = [len(bags[f][b]) for f in FEATURES for b in firsts[f]]
    values = [v for f in FEATURES for b in firsts[f] for v in bags[f][b]]
    weights = None if wts is None else torch.tensor([w for f in FEATURES for b in firsts[f] for w in wts[f][b]])
    return KeyedJaggedTensor(
        FEATURES,
        torch.tensor(values, dtype=torch.long),
        weights,
        torch.tensor(lengths, dtype=torch.long),
        stride_per_key_per_rank=[[len(firsts[f])] for f in FEATURES],
        inverse_indices=(FEATURES, inverse),
    )


def pairs(steps: list[tuple]) -> list[tuple]:
    """``f0`` of each pair's second sample becomes the first's (the batch VBE describes)."""
    for bags, wts, _, _ in steps:
        for b in range(1, GLOBAL_BATCH, 2):
            bags["f0"][b] = bags["f0"][b - 1]
            if wts is not None:
                wts["f0"][b] = wts["f0"][b - 1]
    return steps


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(40, 8, "t_big", feature_names=["f0", "f1"], pooling=PoolingType.MEAN),
                EmbeddingBagConfig(2, 12, "t_small", feature_names=["f2"]),
                EmbeddingBagConfig(40, 12, "t_user", feature_names=["f0"]),
            ],
            is_weighted=True,
        )
        self.top = nn.Linear(3 + 40, 1)

    def forward(self, dense, kjt):
        kt = self.ebc(kjt)
        assert kt.keys() == KEYS, kt.keys()
        return self.top(torch.cat([dense, kt.values()], 1)).squeeze(1), kt.values()


class Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(40, 8, "t_big", feature_names=["f0", "f1"]),
                EmbeddingConfig(2, 12, "t_small", feature_names=["f2"]),
                EmbeddingConfig(40, 12, "t_user", feature_names=["f0"]),
            ]
        )

    def forward(self, kjt):
        return self.ec(kjt)


def seq_loss(out) -> torch.Tensor:
    return sum((jt.values().sin() * (i + 1)).sum() for i, jt in enumerate(out.values()))


def shards_of(dmp) -> dict:
    return {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}


def train_sharded(rank, world, cases):
    from lightning_shardrec.distributed import DistributedModelParallel

    results = []
    for kind, uneven in cases:
        sizes = splits(world, uneven)
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        plan = plan_of(dict.fromkeys(SHAPES, kind), SHAPES, world)
        ebc = DistributedModelParallel(
            Rec(),
            plan=ShardingPlan({"ebc": plan}),
            embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=LR, eps=1e-8),
        )
        dense_opt = torch.optim.Adagrad(list(ebc.dense_parameters()), lr=LR, eps=1e-8)
        pooled = []
        for bags, wts, dense, label in pairs(random_steps(3, True, ROWS, STEPS)):
            logits, out = ebc(dense[lo:hi], vbe_kjt_of(bags, wts, lo, hi))
            pooled.append(out.detach().clone())
            dense_opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(logits, label[lo:hi], reduction="sum")
            (loss * world / GLOBAL_BATCH).backward()
            dense_opt.step()
        seq = DistributedModelParallel(
            Seq(), plan=ShardingPlan({"ec": plan}), embedding_optimizer=FusedOptimConfig(optimizer="sgd", lr=LR)
        )
        dense = list(seq.dense_parameters())  # data-parallel tables
        seq_opt = torch.optim.SGD(dense, lr=LR) if dense else None
        rows = []
        for bags, _, _, _ in pairs(random_steps(4, False, ROWS, STEPS)):
            out = seq(vbe_kjt_of(bags, None, lo, hi))
            rows.append({k: (jt.values().detach().clone(), jt.lengths().clone()) for k, jt in out.items()})
            if seq_opt is not None:
                seq_opt.zero_grad()
            (seq_loss(out) * world / GLOBAL_BATCH).backward()
            if seq_opt is not None:
                seq_opt.step()
        results.append((pooled, shards_of(ebc), rows, shards_of(seq)))
    return results


def assemble(results: list, index: int, key: str, like: torch.Tensor) -> torch.Tensor:
    got = torch.full_like(like, float("nan"))
    for r in results:
        for (r0, c0), w in r[index].get(key, []):
            got[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
    return got


def check(case, world, results) -> None:
    kind, uneven = case
    sizes = splits(world, uneven)
    rec = Rec()
    opt = torch.optim.Adagrad(rec.parameters(), lr=LR, eps=1e-8)
    want_pooled = []
    for bags, wts, dense, label in pairs(random_steps(3, True, ROWS, STEPS)):
        logits, out = rec(dense, vbe_kjt_of(bags, wts, 0, GLOBAL_BATCH))
        want_pooled.append(out.detach())
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(logits, label, reduction="mean").backward()
        opt.step()
    seq = Seq()
    sgd = torch.optim.SGD(seq.parameters(), lr=LR)
    want_rows = []
    for bags, _, _, _ in pairs(random_steps(4, False, ROWS, STEPS)):
        out = seq(vbe_kjt_of(bags, None, 0, GLOBAL_BATCH))
        want_rows.append({k: (jt.values().detach(), jt.lengths()) for k, jt in out.items()})
        sgd.zero_grad()
        (seq_loss(out) / GLOBAL_BATCH).backward()
        sgd.step()
    lo = 0
    for rank, (pooled, _, rows, _) in enumerate(results):
        hi = lo + sizes[rank]
        bag_lo = {"f0": lo // 2, "f1": lo, "f2": lo}
        bag_hi = {"f0": (hi + 1) // 2, "f1": hi, "f2": hi}
        for step in range(STEPS):
            torch.testing.assert_close(pooled[step], want_pooled[step][lo:hi], **TOL, msg=f"{case} rank {rank} pooled")
            assert list(rows[step]) == KEYS
            for k in KEYS:
                f = k.split("@")[0]
                values, lengths = want_rows[step][k]
                b0, b1 = bag_lo[f], bag_hi[f]
                start, end = int(lengths[:b0].sum()), int(lengths[:b1].sum())
                torch.testing.assert_close(rows[step][k][1], lengths[b0:b1], msg=f"{case} rank {rank} {k} lengths")
                torch.testing.assert_close(rows[step][k][0], values[start:end], **TOL, msg=f"{case} rank {rank} {k}")
        lo = hi
    for t in SHAPES:
        want = rec.ebc.embedding_bags[t].weight.detach()
        torch.testing.assert_close(assemble(results, 1, f"ebc.embedding_bags.{t}.weight", want), want, **TOL)
        want = seq.ec.embeddings[t].weight.detach()
        torch.testing.assert_close(assemble(results, 3, f"ec.embeddings.{t}.weight", want), want, **TOL)


@pytest.mark.parametrize("world", [2, 3])
def test_vbe_every_sharding_type_matches_unsharded(world):
    cases = [(kind, False) for kind in TYPES] + [(kind, True) for kind in ("row_wise", "table_wise")]
    per_rank = run_ranks(train_sharded, world, cases)
    for i, case in enumerate(cases):
        check(case, world, [r[i] for r in per_rank])
