"""DistributedModelParallel: planner-driven mixed plans, bad input that must not hang."""

from __future__ import annotations

import pytest
import torch
from test_sharded_ebc import GLOBAL_BATCH, LR, Rec, check, kjt_of, loss_fn, make_data, make_optimizers, splits

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor, PoolingType
from lightning_shardrec.testing import run_ranks


def train_planned(rank, world, constraints):
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    planner = EmbeddingShardingPlanner(
        Topology(world, compute_device="cpu"),
        batch_size=GLOBAL_BATCH // world,
        constraints={t: ParameterConstraints(sharding_types=[s]) for t, s in constraints.items()},
    )
    dmp = DistributedModelParallel(
        Rec(PoolingType.SUM, False),
        planner=planner,
        embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=LR, eps=1e-8),
    )
    types = {t: p.sharding_type.value for t, p in dmp.plan.get_plan_for_module("ebc").items()}
    opt = make_optimizers(list(dmp.dense_parameters()), "adagrad")
    sizes = splits(world, False)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    first = None
    for bags, wts, dense, label in make_data(3, False):
        logits, pooled = dmp(dense[lo:hi], kjt_of(bags, wts, lo, hi))
        first = pooled.detach().clone() if first is None else first
        opt.zero_grad()
        loss_fn(logits, label[lo:hi], world).backward()
        opt.step()
    shards = {k: [(m.shard_offsets, w.detach().clone()) for m, w in v] for k, v in dmp.local_shards().items()}
    return (first, shards, {k: v.clone() for k, v in dmp.module.top.state_dict().items()}), types


def test_mixed_plan_from_planner_constraints():
    constraints = {"t_big": "row_wise", "t_small": "table_wise"}
    out = run_ranks(train_planned, 2, constraints)
    assert out[0][1] == constraints
    check(("mixed", "SUM", False, "adagrad", False, 3), 2, [r[0] for r in out])


def bad_batch(rank, world):
    from test_sharded_ebc import plan_for

    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import ShardingPlan

    dmp = DistributedModelParallel(Rec(PoolingType.SUM, False), plan=ShardingPlan({"ebc": plan_for("row_wise", world)}))
    dense = torch.zeros(2, 3)
    good = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 2, 0]), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    messages = []
    bad_id = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 2, 5]), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    missing = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1]), lengths=torch.tensor([1, 0, 0, 0]))
    for bad in (bad_id, missing):
        try:
            dmp(dense, bad if rank == 1 else good)
        except (ValueError, KeyError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    logits, _ = dmp(dense, good)  # the group still works afterwards
    return messages, logits.shape[0]


def test_bad_input_on_one_rank_stops_every_rank_without_hanging():
    (msgs0, n0), (msgs1, n1) = run_ranks(bad_batch, 2, timeout=60)
    assert "feature 'f2' (table 't_small'): id 5 outside [0, 2)" in msgs1[0]
    assert "lacks features ['f2']" in msgs1[1]
    for m in msgs0:
        assert "ShardingError: rank 0: ranks [1] rejected their batch" in m
    assert n0 == n1 == 2


@pytest.mark.parametrize(
    ("current", "environ", "count", "want"),
    [(0, {"LOCAL_RANK": "3"}, 8, 3), (2, {"LOCAL_RANK": "3"}, 8, 2), (0, {}, 8, 0), (0, {"LOCAL_RANK": "x"}, 8, 0)],
)
def test_cuda_index_falls_back_to_local_rank(current, environ, count, want):
    from lightning_shardrec.distributed.dmp.shardable import cuda_index

    assert cuda_index(current, environ, count) == want


def test_cuda_index_rejects_a_local_rank_without_its_gpu():
    from lightning_shardrec.distributed.dmp.shardable import cuda_index

    with pytest.raises(ValueError, match="LOCAL_RANK 4 but only 2 GPUs are visible; pass device="):
        cuda_index(0, {"LOCAL_RANK": "4"}, 2)


def dense_groups(rank, world):
    import torch.distributed as dist
    from test_sharded_ebc import plan_for

    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.comm.groups import cached_group, live_group
    from lightning_shardrec.planner import ShardingPlan

    def build():
        plan = ShardingPlan({"ebc": plan_for("row_wise", world)})
        return DistributedModelParallel(Rec(PoolingType.SUM, False), plan=plan)

    first, second = build(), build()
    shared = first._dmp_wrapped_module.process_group is second._dmp_wrapped_module.process_group
    made = []

    def make():
        made.append(dist.new_group())
        return made[-1]

    a, b = cached_group(("test", rank), make), cached_group(("test", rank), make)
    dist.destroy_process_group(a)
    c = cached_group(("test", rank), make)
    fresh = c is not a and live_group(c) and not live_group(a)
    dist.destroy_process_group(c)
    return shared, a is b, fresh, len(made)


def test_dmps_over_the_same_ranks_share_one_dense_group_until_it_is_destroyed():
    # each group holds transport threads until destroyed: building DMPs again and again must not leak them
    for shared, reused, fresh, made in run_ranks(dense_groups, 2):
        assert (shared, reused, fresh, made) == (True, True, True, 2)


def timed_poolings(rank, world, poolings):
    """The ids per bag each table group's ``kernel="auto"`` timing ran at (None: timed over a range)."""
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.sharding import base
    from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["workload"].pooling)
        return choose(*args, **kwargs)

    choose, base.choose = base.choose, spy
    constraints = {
        t: ParameterConstraints(sharding_types=["table_wise"], **({} if p is None else {"pooling_factors": [p]}))
        for t, p in poolings.items()
    }
    planner = EmbeddingShardingPlanner(Topology(world, compute_device="cpu"), batch_size=8, constraints=constraints)
    DistributedModelParallel(Rec(PoolingType.SUM, False), planner=planner)
    return seen


@pytest.mark.parametrize(
    ("poolings", "timed"),
    [
        ({"t_big": 6.0, "t_small": 2.0}, 4.0),  # both declared: their mean
        ({"t_big": 6.0, "t_small": None}, None),  # one table without: not declared, timed over a range
        ({"t_big": None, "t_small": None}, None),  # constraints for the sharding type only ([1.0] by default)
    ],
)
def test_kernel_auto_times_the_declared_pooling_or_a_range(poolings, timed):
    assert run_ranks(timed_poolings, 1, poolings) == [[timed]]
