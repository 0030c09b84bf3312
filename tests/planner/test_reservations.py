"""TorchRec's storage reservations: the bytes they leave equal TorchRec 1.8's, and the planner fills that."""

from __future__ import annotations

import pytest
import torch
from planner_helpers import bag

import lightning_shardrec as lsr
from lightning_shardrec.errors import MissingTorchRecFeatureError, PlannerError
from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from lightning_shardrec.planner.machine.reservations import (
    FixedPercentageStorageReservation,
    HeuristicalStorageReservation,
    StorageReservation,
)

MiB = 1 << 20


def _model() -> torch.nn.Module:
    """A table of 1,000 x 8 read by two features, and a dense Linear(8, 1000): 9,000 float parameters."""
    config = lsr.EmbeddingBagConfig(num_embeddings=1000, embedding_dim=8, name="t", feature_names=["f", "g"])
    return _with_dense(config)


def _with_dense(config: lsr.EmbeddingBagConfig) -> torch.nn.Module:
    collection = lsr.EmbeddingBagCollection([config], device=torch.device("meta"))
    return torch.nn.Sequential(collection, torch.nn.Linear(8, 1000))


CUDA = Topology(world_size=2, compute_device="cuda", hbm_cap=MiB)
CPU = Topology(world_size=2, compute_device="cpu", ddr_cap=MiB)


@pytest.mark.parametrize(
    ("reservation", "topology", "constraints", "left"),
    [
        # TorchRec 1.8's reserve() on the same model, topology and batch (64), bytes per rank left:
        # 0.9 x 1 MiB - 36,000 B x 6 (dense) - 64 ids x 8 B x 20 (inputs)
        (HeuristicalStorageReservation(0.1), CUDA, None, 717478),
        # pooling factors 3 and 2: 320 ids a step
        (HeuristicalStorageReservation(0.1), CUDA, {"t": ParameterConstraints(pooling_factors=[3.0, 2.0])}, 676518),
        (FixedPercentageStorageReservation(0.25), CUDA, None, 786432),
        # TorchRec's percentage cuts HBM only: on CPU the dense part and the inputs alone
        (HeuristicalStorageReservation(0.1), CPU, None, 822336),
        (FixedPercentageStorageReservation(0.25), CPU, None, MiB),
    ],
)
def test_the_bytes_left_equal_torchrecs(reservation, topology, constraints, left) -> None:
    reserved = reservation.reserve(topology, 64, _model(), [], constraints)
    assert reserved.memory_cap == left and reservation.last_reserved_topology == reserved
    assert reserved.world_size == topology.world_size and reserved.compute_device is topology.compute_device


def test_a_dense_estimate_replaces_the_parameter_count() -> None:
    reserved = HeuristicalStorageReservation(0.1, dense_tensor_estimate=100_000).reserve(CUDA, 64, _model(), [])
    assert reserved.memory_cap == int(0.9 * MiB) - 100_000 - 64 * 8 * 20


def test_the_planner_fills_what_the_reservation_leaves() -> None:
    reservation = HeuristicalStorageReservation(0.1)
    planner = EmbeddingShardingPlanner(CUDA, batch_size=64, storage_reservation=reservation)
    plan = planner.plan(_model())
    assert plan.stats is not None
    assert plan.stats.reserve == pytest.approx(1 - 717478 / MiB)
    assert max(plan.stats.rank_storage) <= 717478
    # one table-wise table of ~0.8 MiB (weights and Adagrad state): it fits in the default 15% reserve's
    # 0.85 MiB, not in the 0.68 MiB this model's dense part and inputs leave
    config = lsr.EmbeddingBagConfig(num_embeddings=1560, embedding_dim=64, name="big", feature_names=["f"])
    model = _with_dense(config)
    table_wise = {"big": ParameterConstraints(sharding_types=["table_wise"])}
    assert EmbeddingShardingPlanner(CUDA, 64, constraints=table_wise).plan(model)
    tight = EmbeddingShardingPlanner(CUDA, 64, storage_reservation=reservation, constraints=table_wise)
    with pytest.raises(PlannerError, match="the reserve is HeuristicalStorageReservation's"):
        tight.plan(model)


def test_a_plan_on_paper_reserves_the_inputs_only() -> None:
    planner = EmbeddingShardingPlanner(CUDA, 64, storage_reservation=HeuristicalStorageReservation(0.1))
    plan = planner.plan({"ebc": [bag("t", 100, 8)]})
    assert plan.stats is not None and plan.stats.reserve == pytest.approx(1 - (int(0.9 * MiB) - 64 * 8 * 20) / MiB)


def test_bad_reservations_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pass reserve=0.2 or storage_reservation=FixedPercentageStorageReservation"):
        EmbeddingShardingPlanner(CUDA, reserve=0.2, storage_reservation=FixedPercentageStorageReservation(0.1))
    with pytest.raises(ValueError, match=r"HeuristicalStorageReservation: percentage must be a number in \[0, 1\]"):
        HeuristicalStorageReservation(1.5)
    with pytest.raises(PlannerError, match="nothing is left for the tables: 1.00 MiB per rank - 90% - dense part"):
        HeuristicalStorageReservation(0.9).reserve(CUDA, 64, _model(), [])
    with pytest.raises(ValueError, match="parameter_multiplier must be a number >= 0, got -1"):
        HeuristicalStorageReservation(0.1, parameter_multiplier=-1)
    with pytest.raises(ValueError, match="dense_tensor_estimate must be None or an int >= 0 .bytes., got 1.5"):
        HeuristicalStorageReservation(0.1, dense_tensor_estimate=1.5)  # type: ignore[arg-type]


class _Generous(StorageReservation):
    def reserve(self, topology, batch_size, module, sharders, constraints=None):  # type: ignore[no-untyped-def]
        return Topology(world_size=topology.world_size, compute_device="cuda", hbm_cap=2 * topology.memory_cap)


def test_a_reservation_of_your_own_must_leave_at_most_the_capacity() -> None:
    planner = EmbeddingShardingPlanner(CUDA, 64, storage_reservation=_Generous())
    with pytest.raises(ValueError, match=r"_Generous.reserve must return a Topology of the same 2 ranks with 1 to"):
        planner.plan(_model())


def test_torchrecs_path() -> None:
    from lightning_shardrec.distributed.planner.storage_reservations import HeuristicalStorageReservation as H
    from lightning_shardrec.distributed.planner.types import StorageReservation

    assert H is HeuristicalStorageReservation and isinstance(H(0.1), StorageReservation)
    with pytest.raises(MissingTorchRecFeatureError, match="InferenceStorageReservation"):
        from lightning_shardrec.distributed.planner.storage_reservations import InferenceStorageReservation  # noqa: F401
