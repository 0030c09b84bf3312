"""Prefetch (the pipelined input distribution) on the sharded collections, without Lightning.

Batch ``i + 1``'s input distribution is started (async collectives on their own
process group) before batch ``i``'s forward; every forward output and every weight
after the steps must be bit-identical to the run without prefetch.
"""

from __future__ import annotations

import pytest
import torch
from test_sharded_ebc import Rec, kjt_of, loss_fn, make_data, make_optimizers, plan_for, splits

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor, PoolingType
from lightning_shardrec.testing import run_ranks


def train(rank, world, kind, pipelined, weighted=True, miss_at=None):
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.comm.groups import new_group_like
    from lightning_shardrec.planner import ShardingPlan

    dmp = DistributedModelParallel(
        Rec(PoolingType.MEAN, weighted),
        plan=ShardingPlan({"ebc": plan_for(kind, world)}),
        embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=0.1, eps=1e-8),
        kernel="torch",  # compared bit for bit: one kernel, not a timed choice
    )
    opt = make_optimizers(list(dmp.dense_parameters()), "adagrad")
    coll = dmp.sharded["ebc"]
    sizes = splits(world, uneven=kind == "row_wise")  # row-wise: a rank with an empty batch too
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    steps = [(kjt_of(b, w, lo, hi), d[lo:hi], y[lo:hi]) for b, w, d, y in make_data(5, weighted) * 2]
    if pipelined:
        coll.enable_prefetch(new_group_like(coll.env))
        coll.prefetch(steps[0][0])
    outs = []
    for i, (kjt, dense, label) in enumerate(steps):
        if pipelined and i + 1 < len(steps):
            coll.prefetch(steps[i + 1][0])  # before this batch's forward, as the strategy does
        if miss_at == i:  # an equal KJT, but not the prefetched object: the handle is not used
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values().clone(), kjt.weights_or_none(), kjt.lengths().clone())
        logits, pooled = dmp(dense, kjt)
        outs.append(pooled.detach().clone())
        if pipelined:
            coll.progress_prefetched()  # between forward and backward
        opt.zero_grad()
        loss_fn(logits, label, world).backward()
        opt.step()
    left = len(coll._prefetched)
    coll.drop_prefetched()
    shards = {k: [w.detach().clone() for _, w in v] for k, v in dmp.local_shards().items()}
    return outs, shards, {k: v.clone() for k, v in dmp.module.top.state_dict().items()}, left


@pytest.mark.parametrize("kind", ["row_wise", "column_wise", "data_parallel"])
def test_prefetch_matches_forward_without_it(kind):
    plain = run_ranks(train, 2, kind, False)
    piped = run_ranks(train, 2, kind, True)
    for rank, ((o1, s1, t1, _), (o2, s2, t2, left)) in enumerate(zip(plain, piped, strict=True)):
        assert left == 0, f"rank {rank}: {left} prefetched batches were never consumed"
        for i, (a, b) in enumerate(zip(o1, o2, strict=True)):
            assert torch.equal(a, b), f"{kind} rank {rank} step {i} forward differs"
        for k in s1:
            assert all(torch.equal(a, b) for a, b in zip(s1[k], s2[k], strict=True)), f"{kind} rank {rank}: {k}"
        for k in t1:
            assert torch.equal(t1[k], t2[k]), f"{kind} rank {rank}: dense {k}"


def test_a_kjt_that_was_not_prefetched_falls_back_and_the_handle_is_dropped():
    plain = run_ranks(train, 2, "table_wise", False)
    piped = run_ranks(train, 2, "table_wise", True, True, 2)
    for (o1, s1, _, _), (o2, s2, _, left) in zip(plain, piped, strict=True):
        assert left == 0
        assert all(torch.equal(a, b) for a, b in zip(o1, o2, strict=True))
        assert all(torch.equal(a, b) for k in s1 for a, b in zip(s1[k], s2[k], strict=True))


def sequence(rank, world, pipelined, kind):
    from test_sharded_ec import Seq, projections, seq_loss
    from test_sharded_ec import kjt_of as seq_kjt
    from test_sharded_ec import make_data as seq_data
    from test_sharded_ec import plan_for as seq_plan

    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.comm.groups import new_group_like
    from lightning_shardrec.planner import ShardingPlan

    dmp = DistributedModelParallel(Seq(), plan=ShardingPlan({"ec": seq_plan(kind, world)}), kernel="torch")
    coll = dmp.sharded["ec"]
    proj = projections()
    lo, hi = rank * 6, rank * 6 + 6
    kjts = [seq_kjt(b, lo, hi) for b in seq_data(7)]
    if pipelined:
        coll.enable_prefetch(new_group_like(coll.env))
        coll.prefetch(kjts[0])
    rows = []
    for i, kjt in enumerate(kjts):
        if pipelined and i + 1 < len(kjts):
            coll.prefetch(kjts[i + 1])
        out = dmp(kjt)
        rows.append({f: jt.values().detach().clone() for f, jt in out.items()})
        coll.progress_prefetched()
        (seq_loss(out, proj) * world / 12).backward()
    return rows, {k: [w.detach().clone() for _, w in v] for k, v in dmp.local_shards().items()}


@pytest.mark.parametrize("kind", ["mixed_a", "mixed_b"])
def test_sequence_collection_prefetch_matches(kind):
    plain, piped = run_ranks(sequence, 2, False, kind), run_ranks(sequence, 2, True, kind)
    for (r1, s1), (r2, s2) in zip(plain, piped, strict=True):
        assert all(torch.equal(a[f], b[f]) for a, b in zip(r1, r2, strict=True) for f in a)
        assert all(torch.equal(a, b) for k in s1 for a, b in zip(s1[k], s2[k], strict=True))


def bad_prefetch(rank, world):
    from test_sharded_ebc import plan_for as ebc_plan

    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.comm.groups import new_group_like
    from lightning_shardrec.planner import ShardingPlan

    dmp = DistributedModelParallel(
        Rec(PoolingType.SUM, False), plan=ShardingPlan({"ebc": ebc_plan("row_wise", world)}), kernel="torch"
    )
    coll = dmp.sharded["ebc"]
    messages = []
    try:
        coll.prefetch(kjt_of(*make_data(1, False)[0][:2], 0, 2))
    except RuntimeError as e:
        messages.append(str(e))
    try:
        coll.enable_prefetch(type(coll.env)(rank, world + 1))
    except ValueError as e:
        messages.append(str(e))
    coll.enable_prefetch(new_group_like(coll.env))
    dense = torch.zeros(2, 3)
    good = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 2, 0]), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    bad = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 2, 5]), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    mine = bad if rank == 1 else good
    coll.prefetch(mine)  # does not raise: the failure flag travels in the header
    try:
        dmp(dense, mine)
    except (ValueError, KeyError) as e:
        messages.append(f"{type(e).__name__}: {e}")
    coll.prefetch(good)
    logits, _ = dmp(dense, good)  # the groups still work afterwards
    return messages, logits.shape[0], len(coll._prefetched)


def test_bad_prefetched_batch_raises_on_every_rank_at_its_forward():
    (m0, n0, left0), (m1, n1, left1) = run_ranks(bad_prefetch, 2, timeout=60)
    assert "ShardedEmbeddingBagCollection.prefetch: prefetch is off; call enable_prefetch(env)" in m0[0]
    assert "the prefetch group has rank 0 of 3, the collection's group rank 0 of 2" in m0[1]
    assert "ShardingError: rank 0: ranks [1] rejected their batch" in m0[2]
    assert "IdOutOfRangeError: feature 'f2' (table 't_small'): id 5 outside [0, 2)" in m1[2]
    assert n0 == n1 == 2 and left0 == left1 == 0
