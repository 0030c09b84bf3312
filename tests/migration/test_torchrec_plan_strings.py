"""Sharding types and kernels as TorchRec has them: plain strings in constraints and plans, and
``repr`` of a plan equal to TorchRec's for the same plan (issue 43, item 2).

The expected texts were printed by TorchRec 1.8 (``/work/venvs/torchrec``) with this program:

    ebc = torchrec.EmbeddingBagCollection(device="meta", tables=[
        EmbeddingBagConfig(name="t1", embedding_dim=D1, num_embeddings=N1, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=D2, num_embeddings=N2, feature_names=["f2"])])
    constraints = {"t1": ParameterConstraints(sharding_types=[T1]), "t2": ParameterConstraints(sharding_types=[T2])}
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device=DEVICE),
                                    constraints=constraints).plan(ebc, [EmbeddingBagCollectionSharder()])
    print(repr(plan))

with the values of each case below.
"""

from __future__ import annotations

import json

import pytest

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from lightning_shardrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from lightning_shardrec.distributed.types import ShardingType

_UNSET = (
    "cache_params=None, enforce_hbm=None, stochastic_rounding=None, bounds_check_mode=None, output_dtype=None, "
    "key_value_params=None"
)
CASES = {
    # (D1, N1, T1, D2, N2, T2, DEVICE) -> TorchRec's repr(plan)
    (64, 100, "column_wise", 32, 50, "table_wise", "cpu"): (
        "ShardingPlan(plan={'': {'t1': ParameterSharding(sharding_type='column_wise', compute_kernel='fused', "
        "ranks=[0], sharding_spec=EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=[0, 0], "
        f"shard_sizes=[100, 64], placement=rank:0/cpu)]), {_UNSET}), 't2': ParameterSharding("
        "sharding_type='table_wise', compute_kernel='fused', ranks=[1], sharding_spec=EnumerableShardingSpec("
        "shards=[ShardMetadata(shard_offsets=[0, 0], shard_sizes=[50, 32], placement=rank:1/cpu)]), "
        f"{_UNSET})}}}})"
    ),
    (16, 10, "data_parallel", 64, 40, "row_wise", "cuda"): (
        "ShardingPlan(plan={'': {'t1': ParameterSharding(sharding_type='data_parallel', compute_kernel='dense', "
        f"ranks=[0, 1], sharding_spec=None, {_UNSET}), 't2': ParameterSharding(sharding_type='row_wise', "
        "compute_kernel='fused', ranks=[0, 1], sharding_spec=EnumerableShardingSpec(shards=[ShardMetadata("
        "shard_offsets=[0, 0], shard_sizes=[20, 64], placement=rank:0/cuda:0), ShardMetadata(shard_offsets=[20, 0], "
        f"shard_sizes=[20, 64], placement=rank:1/cuda:1)]), {_UNSET})}}}})"
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_repr_of_a_plan_equals_torchrecs(case):
    d1, n1, t1, d2, n2, t2, device = case
    ebc = EmbeddingBagCollection(
        device="meta",
        tables=[
            EmbeddingBagConfig(name="t1", embedding_dim=d1, num_embeddings=n1, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=d2, num_embeddings=n2, feature_names=["f2"]),
        ],
    )
    constraints = {"t1": ParameterConstraints(sharding_types=[t1]), "t2": ParameterConstraints(sharding_types=[t2])}
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device=device), constraints=constraints
    ).plan(ebc, [EmbeddingBagCollectionSharder()])
    assert repr(plan) == CASES[case]


def test_constraints_and_plans_hold_the_strings_given():
    c = ParameterConstraints(sharding_types=["column_wise"], compute_kernels=["fused"])
    assert c.sharding_types == ["column_wise"] and repr(c.sharding_types) == "['column_wise']"
    kind = c.sharding_types[0]
    assert isinstance(kind, str) and kind == "column_wise" and str(kind) == "column_wise"
    assert f"{kind}|{kind:>12}" == "column_wise| column_wise"
    assert hash(kind) == hash("column_wise") and {"column_wise": 1}[kind] == 1
    assert json.dumps({"t": kind}) == '{"t": "column_wise"}'
    assert ShardingType.COLUMN_WISE.value == "column_wise" and kind == ShardingType.COLUMN_WISE
    assert str(c.compute_kernels[0]) == "fused" and repr(c.compute_kernels[0]) == "'fused'"
