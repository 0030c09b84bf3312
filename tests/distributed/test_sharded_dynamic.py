"""Dynamic tables sharded on 1-4 ranks equal the unsharded module trained on the global batch.

Pooled (EBC, weighted too) and sequence (EC) collections with two dynamic tables (LRU with a
time-to-live; LFU with ``min_count`` admission and a small candidate table) beside a static
one, each dynamic table row-wise by bucket ranges or table-wise, trained with every fused
optimizer: per step the forward outputs, and after training every table's weights, the id
mappers' slot and candidate buffers, their step and (summed over ranks) counters, and eval and no_grad
forwards equal the unsharded run's. Evictions, expirations, misses and dropped candidates
happen (asserted), so eviction, ttl and admission are exercised.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from _plans import kjt_of, splits

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.configs import EmbeddingConfig, FusedOptimConfig, PoolingType
from lightning_shardrec.modules import optimizer_reset_hook
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.testing import run_ranks

GLOBAL, STEPS, LR = 12, 6, 0.1
EPS = {"adam": 1e-12, "adamw": 1e-12}  # SparseAdam's eps sits before the bias correction: keep it tiny
TOL = {"rtol": 1e-5, "atol": 1e-6}
OPTIMS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"]
BUFFERS = ("slot_ids", "slot_step", "slot_count", "slot_gen")
CANDS = ("cand_ids", "cand_step", "cand_count")
#: (pooled, weighted, dynamic tables' sharding, optimizer)
CASES = [
    (pooled, pooled and optim in ("adagrad", "adam"), kind, optim)
    for pooled in (True, False)
    for kind in ("row_wise", "table_wise")
    for optim in OPTIMS
]


def tables(pooled: bool) -> list:
    """``user`` (u1, u2; 6 buckets of 8, LRU, ttl 2), ``item`` (4 buckets of 6, LFU, min_count 2), static ``s``."""
    cls = EmbeddingBagConfig if pooled else EmbeddingConfig
    pool = {"pooling": PoolingType.MEAN} if pooled else {}
    return [
        cls(
            name="user",
            embedding_dim=8,
            num_embeddings=48,
            feature_names=["u1", "u2"],
            dynamic=DynamicConfig(num_buckets=6, ttl_steps=2, seed=3),
            **pool,
        ),
        cls(
            name="item",
            embedding_dim=4 if pooled else 8,
            num_embeddings=24,
            feature_names=["i"],
            dynamic=DynamicConfig(num_buckets=4, eviction="lfu", min_count=2, candidates_per_bucket=2),
        ),
        cls(name="s", embedding_dim=4 if pooled else 8, num_embeddings=10, feature_names=["c"]),
    ]


def module(pooled: bool, weighted: bool):
    torch.manual_seed(0)
    if pooled:
        return EmbeddingBagCollection(tables(True), is_weighted=weighted)
    return EmbeddingCollection(tables(False))


def batches(weighted: bool) -> list[tuple[dict, dict | None, torch.Tensor]]:
    """Global batches of raw ids from a drifting pool (old ids fade, new ones come), 0-4 ids per bag;
    step 2 has no ``item`` ids at all."""
    rng = random.Random(11)
    pool = [rng.choice([-1, 1]) * rng.randrange(2**62) for _ in range(150)]
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        window = pool[step * 15 : step * 15 + 60]
        bags = {
            f: [
                [rng.choice(window if f != "i" else window[:20]) for _ in range(rng.randrange(5))]
                for _ in range(GLOBAL)
            ]
            for f in ("u1", "u2", "i")
        }
        if step == 2:  # no item ids anywhere: its mappers still take the step
            bags["i"] = [[] for _ in range(GLOBAL)]
        bags["c"] = [[rng.randrange(10) for _ in range(rng.randrange(3))] for _ in range(GLOBAL)]
        wts = {f: [[rng.random() + 0.5 for _ in b] for b in bags[f]] for f in bags} if weighted else None
        out.append((bags, wts, torch.randn(GLOBAL, 40, generator=g)))
    return out


def plan(world: int, kind: str, capacity: dict[str, tuple[int, int, int]]) -> ShardingPlan:
    """Dynamic tables ``kind`` (row_wise: near-equal bucket ranges, rotated), the static table table-wise."""
    out = {}
    for i, (name, (rows, dim, buckets)) in enumerate(capacity.items()):
        if kind == "table_wise" or not buckets:
            shards = [ShardMetadata((0, 0), (rows, dim), (i + 1) % world)]
            st = ShardingType.TABLE_WISE
        else:
            slots, holders = rows // buckets, min(world, buckets)
            counts = [buckets // holders + (k < buckets % holders) for k in range(holders)]
            starts = [sum(counts[:k]) for k in range(holders)]
            shards = [
                ShardMetadata((s * slots, 0), (n * slots, dim), (k + i) % world)
                for k, (s, n) in enumerate(zip(starts, counts, strict=True))
            ]
            st = ShardingType.ROW_WISE
        out[name] = ParameterSharding(st, EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards)
    return ShardingPlan({"": out})


def capacities(pooled: bool) -> dict[str, tuple[int, int, int]]:
    return {
        t.name: (t.num_embeddings, t.embedding_dim, t.dynamic.num_buckets if t.dynamic else 0) for t in tables(pooled)
    }


def loss_of(out, target: torch.Tensor) -> torch.Tensor:
    """Every output row meets a random, nonzero weight (so every row looked up gets a gradient)."""
    if isinstance(out, dict):  # sequence: per feature [N_f, D]
        return sum(
            (jt.values() * target[i % GLOBAL, : jt.values().shape[1]]).sum() for i, jt in enumerate(out.values())
        )
    return (out.values() * target[: out.values().shape[0], : out.values().shape[1]]).sum()


def flat(out) -> torch.Tensor:
    if isinstance(out, dict):
        return torch.cat([jt.values() for jt in out.values()]).detach().clone()
    return out.values().detach().clone()


def train_sharded(rank: int, world: int, cases: list) -> list:
    from lightning_shardrec.distributed import DistributedModelParallel

    results = []
    for pooled, weighted, kind, optim in cases:
        fbgemm = fbgemm_available() and optim in ("sgd", "adagrad", "rowwise_adagrad") and kind == "row_wise"
        backend = "fbgemm" if fbgemm else "torch"  # without fbgemm: the portable kernel, the same expectations
        config = FusedOptimConfig(optimizer=optim, lr=LR, eps=EPS.get(optim, 1e-8))
        dmp = DistributedModelParallel(
            module(pooled, weighted),
            plan=plan(world, kind, capacities(pooled)),
            embedding_optimizer=config,
            kernel=backend,
        )
        sizes = splits(world, uneven=kind == "table_wise")
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        outs = []
        for bags, wts, target in batches(weighted):
            out = dmp(kjt_of(bags, wts if pooled else None, lo, hi))
            outs.append(flat(out))
            target = target[lo:hi] if pooled else target
            (loss_of(out, target) * world).backward()
        last = kjt_of(*batches(weighted)[-1][:2], lo, hi)
        dmp.eval()  # eval, then no_grad in training mode: nothing admitted, evicted or counted
        outs.append(flat(dmp(last)))
        dmp.train()
        with torch.no_grad():
            outs.append(flat(dmp(last)))
        sharded = dmp.sharded[""]
        mappers = {
            name: (m.row_offset, m.bucket_lo * m.cands_per_bucket, {k: v.clone() for k, v in m.state_dict().items()})
            for name, m in sharded.dynamic_mappers().items()
        }
        shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
        results.append((outs, mappers, shards))
    return results


class RowwiseAdagrad(torch.optim.Optimizer):
    """``sum[row] += mean(g[row]^2); w[row] -= lr * g[row] / (sqrt(sum[row]) + eps)`` (the fused rule)."""

    def __init__(self, params, lr: float, eps: float) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    s = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                    s += p.grad.pow(2).mean(1)
                    p -= group["lr"] * p.grad / (s.sqrt() + group["eps"]).unsqueeze(1)

    def reset_hook(self, table: str, weight: torch.Tensor, slots: torch.Tensor) -> None:
        if "sum" in self.state.get(weight, {}):
            self.state[weight]["sum"][slots] = 0


class RowSparseAdam(torch.optim.SparseAdam):
    """SparseAdam on the rows a step touched (the fused row-sparse rule), from dense gradients."""

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = p.grad.to_sparse(1)
        super().step()


def reference_optimizer(name: str, model) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR)
    if name == "adagrad":
        opt: torch.optim.Optimizer = torch.optim.Adagrad(params, lr=LR, eps=1e-8)
    elif name == "rowwise_adagrad":
        opt = RowwiseAdagrad(params, lr=LR, eps=1e-8)
        model.register_reset_hook(opt.reset_hook)
        return opt
    else:  # adam; adamw without weight decay is the same rule
        opt = RowSparseAdam(params, lr=LR, eps=EPS[name])
    model.register_reset_hook(optimizer_reset_hook(opt))
    return opt


@functools.cache
def reference(pooled: bool, weighted: bool, optim: str):
    """The unsharded run: outputs per step (then eval, then no_grad), final state dict, stats."""
    model = module(pooled, weighted)
    opt = reference_optimizer(optim, model)
    outs = []
    for bags, wts, target in batches(weighted):
        out = model(kjt_of(bags, wts if pooled else None, 0, GLOBAL))
        outs.append(flat(out))
        opt.zero_grad()
        loss_of(out, target).backward()
        opt.step()
    last = kjt_of(*batches(weighted)[-1][:2], 0, GLOBAL)
    model.eval()
    outs.append(flat(model(last)))
    model.train()
    with torch.no_grad():
        outs.append(flat(model(last)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return outs, state, model.dynamic_stats()


def check_outputs(case, world: int, results: list, ref_outs: list) -> None:
    pooled, weighted, kind, optim = case
    sizes = splits(world, uneven=kind == "table_wise")
    bounds = [sum(sizes[:r]) for r in range(world + 1)]
    for step, want in enumerate(ref_outs):
        if pooled:
            got = torch.cat([r[0][step] for r in results])
        else:  # per feature, rank by rank: reorder the reference's (feature, sample) rows the same way
            bags = batches(weighted)[min(step, STEPS - 1)][0]
            n = {f: [len(b) for b in bags[f]] for f in bags}
            pieces, start = {}, 0
            for f in bags:
                total = sum(n[f])
                pieces[f] = want[start : start + total]
                start += total
            want = torch.cat(
                [pieces[f][sum(n[f][: bounds[r]]) : sum(n[f][: bounds[r + 1]])] for r in range(world) for f in bags]
            )
            got = torch.cat([r[0][step] for r in results])
        torch.testing.assert_close(got, want, **TOL, msg=f"{case} world {world} step {step} forward")


def check(case, world: int, results: list) -> None:
    pooled, weighted, kind, optim = case
    ref_outs, state, stats = reference(pooled, weighted, optim)
    check_outputs(case, world, results, ref_outs)
    prefix = "embedding_bags" if pooled else "embeddings"
    for table in ("user", "item", "s"):
        want = state[f"{prefix}.{table}.weight"]
        got = torch.full_like(want, float("nan"))
        for _, _, shards in results:
            for (r0, c0), w in shards.get(f"{prefix}.{table}.weight", []):
                got[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
        torch.testing.assert_close(got, want, **TOL, msg=f"{case} world {world} table {table}")
    for table in ("user", "item"):
        key = f"dynamic_tables.{table}"
        held = [r[1][table] for r in results if table in r[1]]
        expect_holders = 1 if kind == "table_wise" else min(world, capacities(pooled)[table][2])
        assert len(held) == expect_holders, (case, world, table)
        for name in BUFFERS + CANDS:
            want = state[f"{key}.{name}"]
            got = torch.full_like(want, -99)
            for row_offset, cand_offset, buffers in held:
                at = row_offset if name in BUFFERS else cand_offset
                got[at : at + buffers[name].numel()] = buffers[name]
            assert torch.equal(got, want), (case, world, table, name)
        for _, _, buffers in held:  # every holder mapped every training forward
            assert int(buffers["step"]) == int(state[f"{key}.step"]) == STEPS
        counters = sum(b["counters"].view(-1, 5).sum(0) for _, _, b in held)
        assert torch.equal(counters, state[f"{key}.counters"].view(-1, 5).sum(0)), (case, world, table)
    # eviction, ttl and admission really happened
    assert stats["user"]["evictions"] > 0 and stats["user"]["expirations"] > 0
    assert stats["item"]["misses"] > 0 and stats["item"]["dropped_candidates"] > 0 and stats["item"]["evictions"] > 0


def run_world(world: int, cases: list) -> None:
    results = run_ranks(train_sharded, world, cases, timeout=600)
    for i, case in enumerate(cases):
        check(case, world, [r[i] for r in results])


def cases_for(world: int) -> list:
    """1 and 2 ranks: every case; 3 and 4 ranks: complementary halves, each still with every
    optimizer, pooled and sequence, row-wise and table-wise."""
    return CASES if world <= 2 else [c for i, c in enumerate(CASES) if i % 2 == world % 2]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_dynamic_tables_match_unsharded(world: int) -> None:
    run_world(world, cases_for(world))


@pytest.mark.slow
def test_sharded_dynamic_tables_match_unsharded_on_four_ranks() -> None:
    run_world(4, cases_for(4))


def vbe_is_refused(rank: int, world: int) -> bool:
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.errors import ShardingError
    from tests.modules.test_vbe import KEYS, vbe

    table = EmbeddingBagConfig(name="d", embedding_dim=4, num_embeddings=8, feature_names=KEYS, dynamic=DynamicConfig())
    dmp = DistributedModelParallel(EmbeddingBagCollection([table]), kernel="torch")
    with pytest.raises(ShardingError, match=r"dynamic tables \['d'\] do not take a variable-batch \(VBE\) KeyedJagged"):
        dmp(vbe())
    return True


def test_variable_batch_kjt_is_refused_for_sharded_dynamic_tables() -> None:
    """A sharded EBC expands a VBE batch: repeated bags would count as sightings (the unsharded EBC refuses it too)."""
    assert run_ranks(vbe_is_refused, 1) == [True]
