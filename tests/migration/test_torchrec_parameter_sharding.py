"""TorchRec's ``ParameterSharding`` arguments, and plan JSON that keeps where the shards live (issue 43).

Expected reprs are TorchRec 1.8's own (``/work/venvs/torchrec``: ``ParameterSharding('table_wise', 'fused',
[2], EnumerableShardingSpec([...]), cache_params=CacheParams(load_factor=0.2), enforce_hbm=True,
bounds_check_mode=BoundsCheckMode.WARNING, output_dtype=DataType.FP32)``, printed there).
"""

from __future__ import annotations

import pytest

from lightning_shardrec.distributed.types import CacheParams, KeyValueParams, ParameterSharding, ShardMetadata
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.modules.embedding_configs import DataType
from lightning_shardrec.planner import ShardingPlan
from lightning_shardrec.planner.plans.table_params import BoundsCheckMode

TORCHREC_REPR = (
    "ParameterSharding(sharding_type='table_wise', compute_kernel='fused', ranks=[2], "
    "sharding_spec=EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=[0, 0], shard_sizes=[10, 4], "
    "placement=rank:2/cpu)]), cache_params=CacheParams(algorithm=None, load_factor=0.2, reserved_memory=None, "
    "precision=None, prefetch_pipeline=None, stats=None, multipass_prefetch_config=None), enforce_hbm=True, "
    "stochastic_rounding=None, bounds_check_mode=<BoundsCheckMode.WARNING: 1>, "
    "output_dtype=<DataType.FP32: 'FP32'>, key_value_params=None)"
)


def _tw(**kwargs: object) -> ParameterSharding:
    return ParameterSharding("table_wise", "fused", [2], [ShardMetadata([0, 0], [10, 4], 2)], **kwargs)  # type: ignore[arg-type]


def test_torchrecs_keyword_arguments_are_kept_and_print_as_torchrec_prints_them() -> None:
    ps = _tw(
        cache_params=CacheParams(load_factor=0.2), enforce_hbm=True,
        bounds_check_mode=BoundsCheckMode.WARNING, output_dtype=DataType.FP32,
    )  # fmt: skip
    assert repr(ps) == TORCHREC_REPR
    assert ps != _tw() and hash(ps) != hash(_tw())
    assert ps.bounds_check_mode == 1  # fbgemm's value: fbgemm's BoundsCheckMode.WARNING compares equal
    warning = _tw(bounds_check_mode=BoundsCheckMode.WARNING)
    assert _tw(bounds_check_mode="warning") == _tw(bounds_check_mode=1) == warning


def test_a_torchrec_sharding_spec_gives_the_shards_and_ranks() -> None:
    spec = _tw().sharding_spec  # torch's EnumerableShardingSpec, placement rank:2/cpu
    by_keyword = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", sharding_spec=spec)
    assert by_keyword == _tw()
    assert ParameterSharding("table_wise", "fused", [2], spec) == _tw()  # TorchRec's fourth positional
    with pytest.raises(ValueError, match="give the shards once, as shards or as sharding_spec, not both"):
        ParameterSharding("table_wise", "fused", [2], [ShardMetadata([0, 0], [10, 4], 2)], sharding_spec=spec)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"key_value_params": KeyValueParams(ssd_rocksdb_shards=2)}, UnsupportedFeatureError,
         r"ParameterSharding: key_value_params=KeyValueParams\(.*not supported"),
        ({"output_dtype": DataType.FP16}, UnsupportedFeatureError,
         r"ParameterSharding: output_dtype=<DataType.FP16: 'FP16'> is not supported"),
        ({"bounds_check_mode": "loud"}, ValueError,
         "ParameterSharding: unknown bounds_check_mode 'loud'; choose one of FATAL, WARNING, IGNORE, NONE"),
        ({"enforce_hbm": "yes"}, TypeError, "ParameterSharding: enforce_hbm must be True, False or None, got 'yes'"),
        ({"cache_params": {"load_factor": 0.2}}, TypeError, "ParameterSharding: cache_params must be a CacheParams"),
    ],
)  # fmt: skip
def test_settings_that_cannot_be_honoured_are_refused_by_name(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _tw(**kwargs)


def test_plan_json_keeps_the_settings_and_where_the_shards_live() -> None:
    ps = _tw(enforce_hbm=False, stochastic_rounding=True, bounds_check_mode="fatal", output_dtype=DataType.FP32)
    plan = ShardingPlan({"": {"t": ps}}, compute_device="cuda", local_world_size=4)
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan and back.plan[""]["t"] == ps
    assert (back.compute_device, back.local_world_size) == ("cuda", 4)
    assert repr(back) == repr(plan) and "placement=rank:2/cuda:2" in repr(back)
    old = ShardingPlan.from_json('{"plan": {"": {}}}')  # a plan written before these fields: TorchRec's defaults
    assert (old.compute_device, old.local_world_size) == ("cpu", 1)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"plan": {}, "local_world_size": 0}', "local_world_size an int >= 1, got 'cpu' and 0"),
        ('{"plan": {}, "compute_device": 3}', "compute_device must be a device type string"),
        ('{"plan": {"": {"t": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [0], '
         '"shards": [], "cache": 1}}}}', "plan entry for table 't' has unknown fields cache; valid: sharding_type"),
    ],
)  # fmt: skip
def test_bad_plan_json_is_refused_naming_the_field(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardingPlan.from_json(text)
