"""The planner's TorchRec surface: constructor order, defaults, ``plan(module, sharders)``,
``collective_plan`` as a method, and named refusals of the parts we do not implement."""

from __future__ import annotations

import logging

import pytest
import torch
from planner_helpers import bag

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingPlan,
    ShardingType,
    Topology,
)
from lightning_shardrec.planner.search.planner import DEFAULT_BATCH_SIZE


def test_torchrec_positional_order() -> None:
    # (topology, batch_size, enumerator, storage_reservation, proposer, partitioner,
    #  performance_model, stats, constraints, debug)
    cons = {"big": ParameterConstraints(sharding_types=["row_wise"])}
    planner = EmbeddingShardingPlanner(Topology(4), 128, None, None, None, None, None, None, cons, False)
    assert (planner.batch_size, planner.debug) == (128, False)
    plan = planner.plan({"ebc": [bag("big", 100_000), bag("small", 100)]})
    assert plan.plan["ebc"]["big"].sharding_type is ShardingType.ROW_WISE


def test_defaults_without_a_process_group() -> None:
    planner = EmbeddingShardingPlanner()
    assert planner.batch_size == DEFAULT_BATCH_SIZE == 512
    assert planner.topology.world_size == 1
    assert planner.topology.compute_device.value == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "name",
    ["enumerator", "proposer", "partitioner", "performance_model", "stats", "plan_loader"],
)
def test_unimplemented_parts_are_refused_by_name(name: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=rf"EmbeddingShardingPlanner: {name}=object is not supported"):
        EmbeddingShardingPlanner(Topology(2), **{name: object()})
    with pytest.raises(TypeError, match="storage_reservation must be a StorageReservation .* got object"):
        EmbeddingShardingPlanner(Topology(2), storage_reservation=object())


def test_callbacks_refused_timeout_accepted() -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"EmbeddingShardingPlanner: callbacks=list is not supported"):
        EmbeddingShardingPlanner(Topology(2), callbacks=[print])
    assert EmbeddingShardingPlanner(Topology(2), callbacks=[], timeout_seconds=30).plan({"ebc": [bag("t", 10)]})
    with pytest.raises(ValueError, match=r"timeout_seconds must be a positive int or None, got 0"):
        EmbeddingShardingPlanner(Topology(2), timeout_seconds=0)


def test_bad_topology_and_batch_size() -> None:
    with pytest.raises(TypeError, match="topology must be a Topology .* got int"):
        EmbeddingShardingPlanner(4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be a positive int, got True"):
        EmbeddingShardingPlanner(Topology(2), True)  # type: ignore[arg-type]


def test_plan_takes_a_sharders_list_and_a_meta_module() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(1000, 16, "t1", feature_names=["f1"]), EmbeddingBagConfig(50, 8, "t2")],
        device=torch.device("meta"),
    )
    planner = EmbeddingShardingPlanner(Topology(2, compute_device="cpu"))
    plan = planner.plan(module=ebc, sharders=[object()])
    assert isinstance(plan, ShardingPlan) and set(plan.plan[""]) == {"t1", "t2"}
    assert plan == planner.plan(ebc) == planner.plan(ebc, [])


def test_pinned_plan_goes_by_keyword() -> None:
    tables = {"ebc": [bag("big", 100_000), bag("small", 100)]}
    planner = EmbeddingShardingPlanner(Topology(2), batch_size=64)
    pinned = planner.plan(tables)
    assert planner.plan(tables, fixed=pinned) == pinned
    msg = r"sharders must be a list .* got ShardingPlan; a pinned plan now goes by keyword"
    with pytest.raises(TypeError, match=msg):
        planner.plan(tables, pinned)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sharders must be a list of module sharders or None, got str"):
        planner.collective_plan(tables, "ebc")  # type: ignore[arg-type]


def test_debug_logs_the_plan(caplog: pytest.LogCaptureFixture) -> None:
    tables = {"ebc": [bag("t", 100)]}
    with caplog.at_level(logging.INFO, logger="lightning_shardrec.planner.search.planner"):
        EmbeddingShardingPlanner(Topology(2), debug=False).plan(tables)
        assert not caplog.records
        EmbeddingShardingPlanner(Topology(2)).plan(tables)
    assert "EmbeddingShardingPlanner plan for 2 rank(s)" in caplog.text
