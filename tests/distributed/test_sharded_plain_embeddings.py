"""Plain nn.EmbeddingBag / nn.Embedding modules sharded in place by DistributedModelParallel.

Every sharding type, 2 and 3 ranks, each bag mode, 1-D + offsets and 2-D inputs,
per-sample weights and padding_idx: forward outputs and weights after several steps
equal the plain model trained on the global batch; the tables are saved under the
module's own keys (``user.weight``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _plans import plan_of
from torch import nn

from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.planner import ShardingPlan
from lightning_shardrec.testing import run_ranks

GLOBAL, STEPS, LR = 12, 3, 0.1
# SparseAdam adds eps before its bias correction, row-sparse adam after (as torch.optim.Adam);
# with a tiny eps the two rules agree to float rounding.
ADAM_EPS = 1e-12
SHAPES = {"user": (40, 8), "hist": (30, 8), "item": (25, 8)}
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel"]


class TwoTower(nn.Module):
    """A user tower of bags (1-D ids + offsets, weighted in sum mode), a history of 2-D bags, an item lookup."""

    def __init__(self, mode: str, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.EmbeddingBag(*SHAPES["user"], mode=mode, padding_idx=3, sparse=sparse)
        self.hist = nn.EmbeddingBag(*SHAPES["hist"], mode=mode, sparse=sparse)
        self.item = nn.Embedding(*SHAPES["item"], padding_idx=0, sparse=sparse)
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets, psw, hist, item):
        u = self.user(ids, offsets, psw) + self.hist(hist)
        return self.top(u * self.item(item).sum(1)).squeeze(1)


def batches(seed: int, weighted: bool) -> list:
    """Global batches: user bags (0-3 ids, id 3 is padding), 2-D history [G, 2], items [G, 3]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (GLOBAL,), generator=g)
        ids = torch.randint(0, SHAPES["user"][0], (int(lengths.sum()),), generator=g)
        psw = torch.rand(ids.shape, generator=g) + 0.5 if weighted else None
        hist = torch.randint(0, SHAPES["hist"][0], (GLOBAL, 2), generator=g)
        item = torch.randint(0, SHAPES["item"][0], (GLOBAL, 3), generator=g)
        out.append((lengths, ids, psw, hist, item, torch.rand(GLOBAL, generator=g).round()))
    return out


def part(batch, lo: int, hi: int):
    lengths, ids, psw, hist, item, y = batch
    start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
    sub = lengths[lo:hi]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sub.cumsum(0)[:-1]])
    w = None if psw is None else psw[start:end]
    return (ids[start:end], offsets, w, hist[lo:hi], item[lo:hi]), y[lo:hi]


DENSE = {
    "sgd": torch.optim.SGD,
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr, eps=1e-8),
    "adam": torch.optim.Adam,
}


def optimizers(model: nn.Module, optim: str, tables) -> list[torch.optim.Optimizer]:
    dense = [p for n, p in model.named_parameters() if n.startswith("top.")]
    if optim == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=LR)]
    if optim == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=LR, eps=1e-8)]
    # sparse=True modules with SparseAdam: the rule the fused row-sparse adam runs
    return [torch.optim.SparseAdam(tables, lr=LR, eps=ADAM_EPS), torch.optim.Adam(dense, lr=LR)]


def train_sharded(rank, world, cases):
    from lightning_shardrec.distributed import DistributedModelParallel

    results = []
    for kind, mode, optim, weighted in cases:
        plan = ShardingPlan({p: plan_of({p: kind}, {p: SHAPES[p]}, world) for p in SHAPES})
        config = FusedOptimConfig(optimizer=optim, lr=LR, eps=ADAM_EPS if optim == "adam" else 1e-8)
        dmp = DistributedModelParallel(TwoTower(mode, sparse=optim == "adam"), plan=plan, embedding_optimizer=config)
        dense = list(dmp.dense_parameters())
        opt = DENSE[optim](dense, lr=LR)
        lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
        first = None
        for batch in batches(7, weighted):
            args, y = part(batch, lo, hi)
            logits = dmp(*args)
            first = logits.detach().clone() if first is None else first
            opt.zero_grad()
            (F.binary_cross_entropy_with_logits(logits, y, reduction="sum") * world / GLOBAL).backward()
            opt.step()
        shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
        results.append((first, shards, {k: v.clone() for k, v in dmp.module.top.state_dict().items()}))
    return results


def reference(mode: str, optim: str, weighted: bool):
    model = TwoTower(mode, sparse=optim == "adam")
    opts = optimizers(model, optim, [model.user.weight, model.hist.weight, model.item.weight])
    first = None
    for batch in batches(7, weighted):
        args, y = part(batch, 0, GLOBAL)
        logits = model(*args)
        first = logits.detach() if first is None else first
        for o in opts:
            o.zero_grad()
        F.binary_cross_entropy_with_logits(logits, y).backward()
        for o in opts:
            o.step()
    return first, model


def cases_for(world: int) -> list[tuple[str, str, str, bool]]:
    cases = [(kind, "sum", "adagrad", True) for kind in TYPES]
    cases += [("row_wise", "mean", "sgd", False), ("table_wise", "max", "adagrad", False)]
    cases += [("column_wise", "max", "sgd", False), ("table_row_wise", "mean", "adam", False)]
    return cases if world == 2 else cases[:3] + cases[-4:]


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}\n{m}")


@pytest.mark.parametrize("world", [2, 3])
def test_plain_modules_sharded_match_the_plain_model(world):
    cases = cases_for(world)
    per_rank = run_ranks(train_sharded, world, cases)
    for i, (kind, mode, optim, weighted) in enumerate(cases):
        case = f"{kind}/{mode}/{optim}/W={world}"
        first, model = reference(mode, optim, weighted)
        results = [r[i] for r in per_rank]
        close(torch.cat([r[0] for r in results]), first, f"{case} forward")
        for k, v in model.top.state_dict().items():
            close(results[0][2][k], v, f"{case} top {k}")
        for path in SHAPES:
            want = getattr(model, path).weight.detach()
            got = torch.full_like(want, float("nan"))
            for _, shards, _ in results:
                for (r0, c0), w in shards.get(f"{path}.weight", []):
                    got[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
            close(got, want, f"{case} {path}.weight")
