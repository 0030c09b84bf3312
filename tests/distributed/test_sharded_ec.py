"""Exactness of the sharded EmbeddingCollection (sequence tables).

Sharded training on W ranks, each with its slice of a global batch, must equal the
unsharded EmbeddingCollection trained with ``torch.optim`` on the whole batch. For
every sharding type (and three mixed plans) x W in {1, 2, 3, 4} x {sgd, adagrad}:
forward rows and lengths equal, and every table weight equal after 3 steps.
Uneven shapes ride along: tables of different dims (8, 12), a column-wise or grid table cut
into pieces of different widths (12 = 8 + 4), a table with fewer rows than ranks,
empty bags, and (W > 1) batches split unevenly with one rank getting none.
Tolerance: float32, only the summation order differs (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from _plans import GLOBAL_BATCH, plan_of, splits
from torch import nn

from lightning_shardrec import EmbeddingCollection, EmbeddingConfig, FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.planner import (
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from lightning_shardrec.testing import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-6}
TYPES = [t.value for t in ShardingType]
# Mixed plans: per table, its sharding type.
MIXED = {
    "mixed_a": {"t_big": "row_wise", "t_mid": "table_wise", "t_small": "column_wise"},
    "mixed_b": {"t_big": "column_wise", "t_mid": "data_parallel", "t_small": "table_row_wise"},
    "mixed_c": {"t_big": "grid_shard", "t_mid": "row_wise", "t_small": "grid_shard"},
}
STEPS = 3
LR = 0.1
FEATURES = ["f0", "f1", "f2", "f3"]
SHAPES = {"t_big": (40, 8), "t_small": (2, 12), "t_mid": (10, 8)}  # t_small: fewer rows than ranks
ROWS = {"f0": 40, "f1": 40, "f2": 2, "f3": 10}


class Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(num_embeddings=40, embedding_dim=8, name="t_big", feature_names=["f0", "f1"]),
                EmbeddingConfig(num_embeddings=2, embedding_dim=12, name="t_small", feature_names=["f2"]),
                EmbeddingConfig(num_embeddings=10, embedding_dim=8, name="t_mid", feature_names=["f3"]),
            ]
        )

    def forward(self, kjt):
        return self.ec(kjt)


def make_data(seed: int):
    """STEPS global batches as plain lists, so every rank can slice its part."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        bags = {}
        for f in FEATURES:
            sizes = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g).tolist()
            bags[f] = [torch.randint(0, ROWS[f], (n,), generator=g).tolist() for n in sizes]
        for i in range(GLOBAL_BATCH // 2):  # f1 empty in the first half: a rank may see it empty
            bags["f1"][i] = []
        steps.append(bags)
    return steps


def kjt_of(bags, lo: int, hi: int) -> KeyedJaggedTensor:
    lengths = [len(bags[f][i]) for f in FEATURES for i in range(lo, hi)]
    values = [v for f in FEATURES for i in range(lo, hi) for v in bags[f][i]]
    return KeyedJaggedTensor(
        FEATURES, torch.tensor(values, dtype=torch.long), None, torch.tensor(lengths, dtype=torch.long)
    )










def plan_for(kind: str, world: int) -> dict[str, ParameterSharding]:
    """Every table with sharding type ``kind`` (or the types of a ``MIXED`` plan)."""
    return plan_of(MIXED.get(kind) or {name: kind for name in SHAPES}, SHAPES, world)


def projections() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f: torch.randn(12 if f == "f2" else 8, generator=g) for f in FEATURES}


def seq_loss(out, proj) -> torch.Tensor:
    """Sum over every id's row of a nonlinear function of it (no mean: callers scale)."""
    return sum((out[f].values().sin() * proj[f]).sum() for f in FEATURES)


def make_optimizer(params, name):
    return torch.optim.SGD(params, lr=LR) if name == "sgd" else torch.optim.Adagrad(params, lr=LR, eps=1e-8)


def train_sharded(rank, world, cases, kernel="auto"):
    from lightning_shardrec.distributed import DistributedModelParallel

    proj = projections()
    results = []
    for kind, optim, uneven, seed in cases:
        dmp = DistributedModelParallel(
            Seq(),
            plan=ShardingPlan({"ec": plan_for(kind, world)}),
            embedding_optimizer=FusedOptimConfig(optimizer=optim, lr=LR, eps=1e-8),
            kernel=kernel,
        )
        dense = list(dmp.dense_parameters())  # data-parallel tables
        dense_opt = make_optimizer(dense, optim) if dense else None
        sizes = splits(world, uneven)
        lo = sum(sizes[:rank])
        hi = lo + sizes[rank]
        first = None
        for bags in make_data(seed):
            out = dmp(kjt_of(bags, lo, hi))
            if first is None:
                first = {
                    f: (jt.values().detach().clone(), jt.lengths().clone(), jt.weights_or_none())
                    for f, jt in out.items()
                }
            if dense_opt is not None:
                dense_opt.zero_grad()
            # DDP (and the sharded path) average over ranks: W / G makes the sum the global mean
            (seq_loss(out, proj) * world / GLOBAL_BATCH).backward()
            if dense_opt is not None:
                dense_opt.step()
        shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
        results.append((first, shards))
    return results


def reference(case):
    kind, optim, uneven, seed = case
    model = Seq()
    opt = make_optimizer(model.parameters(), optim)
    proj = projections()
    first = None
    for bags in make_data(seed):
        out = model(kjt_of(bags, 0, GLOBAL_BATCH))
        first = {f: (jt.values().detach(), jt.lengths()) for f, jt in out.items()} if first is None else first
        opt.zero_grad()
        (seq_loss(out, proj) / GLOBAL_BATCH).backward()
        opt.step()
    return first, model


def check(case, world, results):
    first, model = reference(case)
    sizes = splits(world, case[2])
    lo = 0
    for rank, (got, _) in enumerate(results):
        hi = lo + sizes[rank]
        assert list(got) == FEATURES, f"{case} rank {rank}: output keys {list(got)}"
        for f in FEATURES:
            rows, lengths = first[f]
            start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
            torch.testing.assert_close(got[f][1], lengths[lo:hi], msg=f"{case} rank {rank} {f} lengths")
            torch.testing.assert_close(got[f][0], rows[start:end], **TOL, msg=f"{case} rank {rank} {f} rows")
            assert got[f][2] is None
        lo = hi
    for table in SHAPES:
        want = model.ec.embeddings[table].weight.detach()
        got = torch.full_like(want, float("nan"))
        covered = 0
        for _, shards in results:
            for (r0, c0), w in shards.get(f"ec.embeddings.{table}.weight", []):
                got[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
                covered += w.numel()
        assert covered >= want.numel(), f"{case} table {table}: shards cover {covered} of {want.numel()} weights"
        torch.testing.assert_close(got, want, **TOL, msg=f"{case} table {table}")


def cases_for(world: int, optim: str) -> list[tuple[str, str, bool, int]]:
    kinds = [*TYPES, *MIXED]
    cases = [(kind, optim, False, 7) for kind in kinds]
    if world > 1:  # uneven batches, one rank with none
        cases += [(kind, optim, True, 11) for kind in kinds]
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["sgd", "adagrad"])
def test_every_sharding_type_matches_unsharded(world, optim):
    cases = cases_for(world, optim)
    per_rank = run_ranks(train_sharded, world, cases)
    for i, case in enumerate(cases):
        check(case, world, [r[i] for r in per_rank])


def test_portable_backend_matches_too():
    cases = [(kind, "adagrad", True, 5) for kind in TYPES]
    per_rank = run_ranks(train_sharded, 2, cases, "torch")
    for i, case in enumerate(cases):
        check(case, 2, [r[i] for r in per_rank])


def bad_batches(rank, world):
    """A rank whose batch is wrong raises its own error; the others stop instead of hanging."""
    from lightning_shardrec.distributed import DistributedModelParallel

    plan = ShardingPlan({"ec": plan_for("row_wise", world)})
    dmp = DistributedModelParallel(Seq(), plan=plan, embedding_optimizer="sgd")
    bags = make_data(1)[0]
    messages = []
    kjt = kjt_of(bags, 0, 2)
    bad_key = KeyedJaggedTensor(["f0"], kjt["f0"].values(), None, kjt["f0"].lengths())
    bad_id = kjt_of({**bags, "f3": [[10]] * GLOBAL_BATCH}, 0, 2)
    for bad in (bad_key, bad_id):
        try:
            dmp(bad if rank == 0 else kjt)
        except Exception as e:  # noqa: BLE001 - the message is the result
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def test_bad_batch_on_one_rank_raises_everywhere():
    (key0, id0), (key1, id1) = run_ranks(bad_batches, 2)
    assert key0.startswith("KeyError") and "ShardedEmbeddingCollection" in key0 and "['f1', 'f2', 'f3']" in key0
    assert id0.startswith("IdOutOfRangeError") and "feature 'f3' (table 't_mid'): id 10 outside [0, 10)" in id0
    for msg in (key1, id1):
        assert msg.startswith("ShardingError") and "ranks [0] rejected their batch" in msg


def missing_table(rank, world):
    from lightning_shardrec.distributed import ShardedEmbeddingCollection, ShardingEnv
    from lightning_shardrec.distributed.sharding import KernelSetup

    plan = plan_for("table_wise", world)
    del plan["t_mid"]
    setup = KernelSetup(optim=FusedOptimConfig(optimizer="sgd"), backend="torch", device=torch.device("cpu"))
    with pytest.raises(Exception, match=r"the sharding plan has no entry for tables \['t_mid'\]"):
        ShardedEmbeddingCollection(Seq().ec, plan, ShardingEnv.from_process_group(), setup)


def test_plan_without_a_table_is_rejected():
    run_ranks(missing_table, 1)
