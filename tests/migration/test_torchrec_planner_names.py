"""TorchRec's planner-side names at their paths (issue 43, item 1): ``CacheParams``, ``KeyValueParams``,
``Storage``, ``Shard``, ``TrainerConfig``, ``HardwareConfig``, ``KernelConfig``,
``hash_planner_context_inputs``, ``validate_compute_kernels``; and the names refused with a reason.

Expected values are TorchRec 1.8's rules (``/work/venvs/torchrec``, ``torchrec/distributed/types.py`` and
``planner/plans/types.py``): ``CacheParams``' hash leaves out ``stats``; ``Storage`` adds, subtracts and orders
field by field (hbm, ddr, ssd) and ``fits_in`` compares every field; ``str(Shard)`` is
``Shard size: (r, c), offset: (r, c), storage: ..., perf: ..., rank: r``; ``TrainerConfig.validate`` needs a
world size and a pod size within it; ``validate_compute_kernels`` lists every violation at once.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.configs import DataType
from lightning_shardrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from lightning_shardrec.distributed.planner.planners import validate_compute_kernels
from lightning_shardrec.distributed.planner.torchrec_types import topology_from_configs
from lightning_shardrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    Shard,
    Storage,
    TrainerConfig,
    hash_planner_context_inputs,
)
from lightning_shardrec.distributed.types import CacheParams, KeyValueParams, ParameterSharding
from lightning_shardrec.errors import MissingTorchRecFeatureError, PlannerError, UnsupportedFeatureError


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        device="meta",
        tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=100 * (i + 1), feature_names=[f"f{i}"])
            for i in range(3)
        ],
    )


def _plan(constraints):
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), constraints=constraints)
    return planner.plan(_ebc())


def test_cache_params_are_accepted_copied_into_the_plan_and_change_no_shard():
    assert hash(CacheParams(load_factor=0.2, stats=object())) == hash(CacheParams(load_factor=0.2))
    assert CacheParams(load_factor=0.2) != CacheParams(load_factor=0.3)
    tuned = ParameterConstraints(
        cache_params=CacheParams(load_factor=0.2), enforce_hbm=True, stochastic_rounding=False,
        bounds_check_mode="fatal", feature_names=["f0"], batch_sizes=[64], output_dtype=DataType.FP32,
    )  # fmt: skip
    assert tuned.cache_params.load_factor == 0.2
    planned, plain = _plan({"t0": tuned}), _plan({})
    assert planned != plain  # TorchRec's planner copies the settings into the plan entry ...
    for name, ps in planned.plan[""].items():  # ... and the shards stay the same
        same = plain.plan[""][name]
        assert (ps.sharding_type, ps.ranks, ps.shards) == (same.sharding_type, same.ranks, same.shards)
    t0 = planned.plan[""]["t0"]
    assert (t0.cache_params, t0.enforce_hbm, t0.stochastic_rounding) == (CacheParams(load_factor=0.2), True, False)
    assert (t0.bounds_check_mode.name, t0.output_dtype) == ("FATAL", DataType.FP32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key_value_params": KeyValueParams(ssd_storage_directory="/tmp")}, r"key_value_params=KeyValueParams\("),
        ({"use_virtual_table": True}, "use_virtual_table=True asks for a key-value"),
        ({"output_dtype": DataType.FP16}, r"output_dtype=<DataType.FP16: 'FP16'> is not supported"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(kwargs, match):
    with pytest.raises(UnsupportedFeatureError, match=match):
        ParameterConstraints(**kwargs)
    assert hash(KeyValueParams(ssd_rocksdb_shards=2)) == hash(KeyValueParams(ssd_rocksdb_shards=2))


def test_storage_and_shard_follow_torchrecs_rules():
    a, b = Storage(hbm=1, ddr=2), Storage(hbm=3, ddr=4, ssd=5)
    assert a + b == Storage(4, 6, 5) and b - a == Storage(2, 2, 5)
    assert a.fits_in(b) and not b.fits_in(a) and not Storage(0, 5).fits_in(Storage(1, 4))
    assert Storage(1, 2, 3) < Storage(1, 3, 0) and hash(a) == hash(Storage(1, 2, 0))
    shard = Shard(size=[10, 4], offset=[0, 4], storage=a, rank=1)
    want = "Shard size: (10, 4), offset: (0, 4), storage: Storage(hbm=1, ddr=2, ssd=0), perf: None, rank: 1"
    assert str(shard) == want
    assert hash(shard) == hash(Shard(size=[10, 4], offset=[0, 4], storage=Storage(1, 2), rank=1))


def test_topology_configs_validate_and_merge():
    with pytest.raises(ValueError, match="world_size must be provided in TrainerConfig"):
        TrainerConfig().validate()
    with pytest.raises(ValueError, match=r"pod_size \(4\) cannot be greater than world_size \(2\)"):
        TrainerConfig(world_size=2, pod_size=4).validate()
    issues = HardwareConfig(hbm_cap_bytes=0, intra_host_bw=1.0, inter_host_bw=2.0).get_validation_issues("cuda")
    assert issues[0] == "hbm_cap_bytes=0 is non-positive" and issues[1].startswith("intra_host_bw (1) < inter_host_bw")
    assert HardwareConfig(hbm_cap_bytes=0).get_validation_issues("cpu") == []
    topo = topology_from_configs(
        TrainerConfig(world_size=4, local_world_size=2, ddr_cap_bytes=2**30),
        HardwareConfig(ddr_cap_bytes=2**40, intra_host_bw=100.0),
        KernelConfig(compute_device="cpu"),
    )
    assert (topo.world_size, topo.local_world_size, topo.ddr_cap, topo.intra_host_bw) == (4, 2, 2**30, 1e5)
    with pytest.raises(UnsupportedFeatureError, match=r"KernelConfig\(compute_device='mtia'\) is not supported"):
        topology_from_configs(TrainerConfig(world_size=1), kernel=KernelConfig(compute_device="mtia"))


def test_hash_planner_context_inputs_is_a_fingerprint_of_the_inputs():
    topo = Topology(world_size=2, compute_device="cpu")
    c = {"t0": ParameterConstraints(sharding_types=["row_wise"])}
    h = hash_planner_context_inputs(topo, 128, constraints=c)
    assert isinstance(h, int) and h == hash_planner_context_inputs(topo, 128, constraints=dict(c))
    assert h != hash_planner_context_inputs(topo, 256, constraints=c)
    assert h != hash_planner_context_inputs(Topology(world_size=4, compute_device="cpu"), 128, constraints=c)
    assert h != hash_planner_context_inputs(topo, 128, constraints={})
    with pytest.raises(UnsupportedFeatureError, match=r"hash_planner_context_inputs\(enumerator=object\)"):
        hash_planner_context_inputs(topo, 128, enumerator=object())
    from lightning_shardrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

    reservation = HeuristicalStorageReservation(percentage=0.15)
    with pytest.raises(ValueError, match="HeuristicalStorageReservation has reserved nothing yet"):
        hash_planner_context_inputs(topo, 128, storage_reservation=reservation, constraints=c)
    reservation.reserve(topo, 128, torch.nn.Linear(4, 4), [], c)
    with_reservation = hash_planner_context_inputs(topo, 128, storage_reservation=reservation, constraints=c)
    assert with_reservation != h
    reservation.reserve(topo, 128, torch.nn.Linear(40, 40), [], c)  # a bigger dense part leaves less
    assert hash_planner_context_inputs(topo, 128, storage_reservation=reservation, constraints=c) != with_reservation


def test_validate_compute_kernels_lists_every_violation():
    plan = _plan({"t1": ParameterConstraints(sharding_types=["data_parallel"])})
    validate_compute_kernels(plan)  # the planner's own plans pass
    bad = {
        "a": ParameterSharding("row_wise", "fused", [0, 1], []),
        "b": ParameterSharding("table_wise", "dense", [0], []),
    }
    option = {"fqn": "c", "compute_kernel": "fused_uvm_caching", "sharding_type": "table_wise"}
    bad_opts = [type("Option", (), option)]
    one = r"failed with 1 violation\(s\):\n  - b: DENSE kernel requires DATA_PARALLEL"
    with pytest.raises(PlannerError, match=one):
        validate_compute_kernels(bad)
    with pytest.raises(PlannerError, match=r"  - c: unknown compute kernel 'fused_uvm_caching' \(valid here: fused"):
        validate_compute_kernels(bad_opts)


@pytest.mark.parametrize(
    ("path", "name", "match"),
    [
        ("modules.mc_modules", "DistanceLFU_EvictionPolicy", "count / distance\\*\\*decay_exponent has no counterpart"),
        ("distributed.planner.shard_estimators", "EmbeddingStorageEstimator", "plan.stats.rank_storage"),
    ],
)
def test_names_that_do_not_map_are_refused_with_the_reason(path, name, match):
    module = importlib.import_module(f"lightning_shardrec.{path}")
    with pytest.raises(MissingTorchRecFeatureError, match=match):
        getattr(module, name)
