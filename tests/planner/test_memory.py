"""Planner memory: what the kernels allocate, the reserve, the device's capacity, the verdict."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.configs import DataType, EmbeddingBagConfig, EmbOptimType, FusedOptimConfig
from lightning_shardrec.errors import PlannerError
from lightning_shardrec.kernels import TableSpec as KernelTable
from lightning_shardrec.kernels import fbgemm_unsupported_reason, make_kernel
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlanStats,
    ShardingPlan,
    Topology,
    Workload,
)
from lightning_shardrec.planner.costs.storage import resident_bytes
from lightning_shardrec.planner.machine import topology as topology_module
from lightning_shardrec.planner.machine.memory import MemoryBudget
from lightning_shardrec.planner.machine.topology import GiB
from lightning_shardrec.planner.plans.tables import table_specs

ROWS, DIM = 1000, 16
CASES = [("torch", o) for o in EmbOptimType] + [
    ("fbgemm", o)
    for o in EmbOptimType
    if fbgemm_available()
    and fbgemm_unsupported_reason(torch.device("cpu"), FusedOptimConfig(optimizer=o), [DIM]) is None
]


@pytest.mark.parametrize("data_type", [DataType.FP32, DataType.FP16])
@pytest.mark.parametrize(("backend", "optimizer"), CASES, ids=[f"{b}-{o.value}" for b, o in CASES])
def test_planner_charges_what_the_kernel_allocates(backend: str, optimizer: EmbOptimType, data_type: DataType) -> None:
    config = EmbeddingBagConfig(
        name="t", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f"], data_type=data_type
    )
    spec = table_specs({"": [config]}, {}, 1)[0]
    work = Workload(topology=Topology(1), batch_size=1, optimizer=optimizer)
    weights, state = resident_bytes(spec, work)
    kernel = make_kernel(
        [KernelTable(name="t", num_embeddings=ROWS, embedding_dim=DIM)],
        [0],
        FusedOptimConfig(optimizer=optimizer),
        pooled=True,
        device="cpu",
        kernel=backend,
    )
    got_weights = sum(w.numel() * w.element_size() for w in kernel.split_weights())
    per_row = [t for s in kernel.split_states() for t in s.values() if t.dim() >= 1 and t.shape[0] == ROWS]
    got_state = sum(t.numel() * t.element_size() for t in per_row)
    assert (weights, state) == (got_weights, got_state)


def _planner(reserve: float | None = None, cap: int = GiB) -> EmbeddingShardingPlanner:
    kwargs = {} if reserve is None else {"reserve": reserve}
    cons = {"t": ParameterConstraints(sharding_types=["table_wise"])}
    return EmbeddingShardingPlanner(Topology(1, hbm_cap=cap), batch_size=8, constraints=cons, **kwargs)


# 3.8M x 32 fp32 + adagrad state = 0.91 GiB: fits 100% of 1 GiB but not the default 85%.
NEAR_FULL = {"": [EmbeddingBagConfig(name="t", num_embeddings=3_800_000, embedding_dim=32, feature_names=["f"])]}


def test_default_reserve_refuses_a_plan_that_fills_the_device() -> None:
    with pytest.raises(
        PlannerError,
        match=r"(?s)table 't' needs \d+ bytes \(0\.91 GiB.*largest free capacity 912680550 bytes.*"
        r"per rank: 1\.00 GiB capacity - 15% reserve \(0\.15 GiB\) = 0\.85 GiB for tables; the reserve is "
        r"kept for the dense model and its optimizer, activations, communication buffers, the CUDA context",
    ):
        _planner().plan(NEAR_FULL)


def test_lower_reserve_plans_it_and_the_verdict_warns() -> None:
    plan = _planner(reserve=0.0).plan(NEAR_FULL)
    assert plan.stats is not None and plan.stats.reserve == 0.0 and plan.stats.tight
    assert plan.stats.verdict().startswith("verdict: max rank 0.91 GiB / capacity 1.00 GiB / headroom 0.09 GiB (9%)")
    assert "WARNING, less than the default 15% (0.15 GiB) left for the dense model" in plan.stats.verdict()
    assert plan.stats.verdict() in str(plan)


def test_verdict_of_a_plan_that_fits() -> None:
    plan = _planner(cap=4 * GiB).plan(NEAR_FULL)
    assert plan.stats is not None and not plan.stats.tight
    assert plan.stats.verdict() == (
        "verdict: max rank 0.91 GiB / capacity 4.00 GiB / headroom 3.09 GiB (77%): "
        "fits, with the 15% reserve (0.60 GiB) kept free"
    )


def test_verdict_of_a_given_plan_over_the_reserve() -> None:
    stats = PlanStats(rank_storage=[9 * GiB], rank_cost=[1e-3], storage_cap=10 * GiB, lower_bound=1e-3, reserve=0.15)
    assert stats.verdict().endswith(
        "DOES NOT FIT the 15% reserve (10.00 GiB capacity - 15% reserve (1.50 GiB) = 8.50 GiB for tables)"
    )


@pytest.mark.parametrize("reserve", [1.0, -0.1, "0.1", True])
def test_bad_reserve(reserve: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"EmbeddingShardingPlanner: reserve is the fraction of each rank's memory kept free for "
        r"the dense model .*; it must be a number in \[0, 1\), got .* \(default 0\.15\)",
    ):
        _planner(reserve=reserve)  # type: ignore[arg-type]


def test_budget_arithmetic() -> None:
    budget = MemoryBudget(80 * GiB, 0.15)
    assert budget.tables + budget.reserved == 80 * GiB
    assert budget.describe() == "80.00 GiB capacity - 15% reserve (12.00 GiB) = 68.00 GiB for tables"


def test_stats_json_keeps_the_reserve_and_reads_older_plans() -> None:
    plan = _planner(cap=4 * GiB).plan(NEAR_FULL)
    again = ShardingPlan.from_json(plan.to_json())
    assert again.stats == plan.stats and again.stats is not None and again.stats.reserve == 0.15
    old = plan.to_json().replace('"reserve": 0.15', '"_": 0').replace(',\n    "_": 0', "")
    assert ShardingPlan.from_json(old).stats.reserve == 0.0  # type: ignore[union-attr]


def test_live_topology_takes_the_gpu_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """On cuda the planner's capacity is the device's total memory (faked here: no GPU on CI)."""
    monkeypatch.setattr(topology_module, "cuda_capacity", lambda: (40 * GiB, "cuda:0 FakeGPU"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert Topology.from_process_group(compute_device="cuda").hbm_cap == 40 * GiB
        assert Topology.from_process_group(compute_device="cuda", hbm_cap=GiB).hbm_cap == GiB
        assert Topology.from_process_group(compute_device="cpu").hbm_cap == 0  # cpu: untouched
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capacity_is_the_device_total() -> None:
    from lightning_shardrec.planner.machine.memory import cuda_capacity

    found = cuda_capacity(0)
    assert found is not None and found[0] == torch.cuda.get_device_properties(0).total_memory


def test_host_memory_is_the_lower_of_meminfo_and_the_cgroup_limit(tmp_path) -> None:
    from lightning_shardrec.planner.machine.memory import host_memory

    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "memory.max"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1000 kB\n")  # 24 GiB
    assert host_memory(str(meminfo), str(tmp_path / "absent")) == 24 * GiB
    cgroup.write_text("8589934592\n")
    assert host_memory(str(meminfo), str(cgroup)) == 8 * GiB
    cgroup.write_text("max\n")  # no limit
    assert host_memory(str(meminfo), str(cgroup)) == 24 * GiB
    assert host_memory(str(tmp_path / "absent"), str(tmp_path / "absent")) is None


def test_live_cpu_topology_shares_the_host_memory_among_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On cpu the ranks of a host share its memory: each plans with host / ranks per host, not 64 GiB."""
    monkeypatch.setattr(topology_module, "host_memory", lambda: 24 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert Topology.from_process_group(compute_device="cpu").ddr_cap == 24 * GiB
        assert Topology.from_process_group(compute_device="cpu", ddr_cap=GiB).ddr_cap == GiB  # given: kept
        monkeypatch.setattr(topology_module, "host_memory", lambda: None)  # unreadable: the named default
        assert Topology.from_process_group(compute_device="cpu").ddr_cap == 64 * GiB
    finally:
        dist.destroy_process_group()
