"""``kernel="auto"`` measures: the faster backend wins, verdicts are cached, pins are honoured, ranks agree."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from lightning_shardrec import kernels
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.kernels import KernelBackend, KernelChoice, TableSpec, TorchBatchedEmbedding, Workload, autotune
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.testing import run_ranks

SPECS = [TableSpec(name=f"t{i}", num_embeddings=n, embedding_dim=8) for i, n in enumerate((50, 30))]
OPTIM = FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.1)
WORK = Workload(batch_size=16, pooling=2.0)
BOTH = {KernelBackend.FBGEMM: None, KernelBackend.TORCH: None}


class SlowKernel(TorchBatchedEmbedding):
    """The torch kernel plus 20 ms per forward: a backend that must lose."""

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        time.sleep(0.02)
        return super().forward(kjt)


def choose(classes, kernel=KernelBackend.AUTO, runnable=None, agree=None) -> KernelChoice:
    return autotune.choose_kernel(
        kernel, runnable or BOTH, classes, SPECS, [0, 1], OPTIM, pooled=True, device=torch.device("cpu"),
        workload=WORK, agree=agree,
    )  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(autotune.PIN_ENV, raising=False)
    return tmp_path / "kernel_choice.json"


@pytest.mark.parametrize("slow", [KernelBackend.FBGEMM, KernelBackend.TORCH])
def test_a_slow_backend_loses(cache, slow):
    fast = KernelBackend.TORCH if slow is KernelBackend.FBGEMM else KernelBackend.FBGEMM
    choice = choose({slow: SlowKernel, fast: TorchBatchedEmbedding})
    assert choice.backend is fast and choice.source == "measured"
    assert choice.seconds[slow.value] > 0.02 > choice.seconds[fast.value]
    ratio = choice.seconds[slow.value] / choice.seconds[fast.value]
    assert choice.label() == f"{fast.value} ({ratio:.1f}x {slow.value})"


def test_a_verdict_holds_for_one_vector_isa(cache, monkeypatch):
    """The same CPU model on an AVX-512 host and on an AVX2 host (one cloud type, two days): the verdict
    measured on one is not read back on the other."""
    monkeypatch.setattr(autotune, "STEADY", math.inf)
    kernels = {KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding}
    keys = []
    for isa in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda isa=isa: isa)
        autotune.machine.cache_clear()
        assert choose(kernels).source == "measured"
        keys.append(next(k for k in json.loads(cache.read_text()) if k not in keys))
    autotune.machine.cache_clear()
    assert "(AVX512) |" in keys[0] and "(AVX2) |" in keys[1]


def test_the_cached_verdict_is_reused(cache, monkeypatch):
    monkeypatch.setattr(autotune, "STEADY", math.inf)  # caching must not depend on this machine's load
    first = choose({KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding})
    stored = json.loads(cache.read_text())
    (key,) = stored
    assert "rowwise_adagrad" in key and "dims 8" in key and autotune.machine() in key
    assert stored[key] == first.seconds

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again despite a cached verdict")

    monkeypatch.setattr(autotune, "measure", no_timing)
    again = choose({KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding})
    assert again.backend is KernelBackend.TORCH and again.source == "cached" and again.seconds == first.seconds
    assert again.label().endswith(", cached)")
    # the verdict, not a default, decides: a cache that says fbgemm is faster picks fbgemm
    cache.write_text(json.dumps({key: {"fbgemm": 0.001, "torch": 0.002}}))
    assert choose({KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding}).backend is (
        KernelBackend.FBGEMM
    )


class SleepyKernel(TorchBatchedEmbedding):
    """The torch kernel plus ``sleeps[i]`` seconds on its ``i``-th forward (warm-up first): load bursts."""

    sleeps: tuple[float, ...] = ()

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls <= len(self.sleeps):
            time.sleep(self.sleeps[self.calls - 1])
        return super().forward(kjt)


class BurstKernel(SleepyKernel):
    """Fast, but the first timed step is hit by a 150 ms burst of other work (beyond the budget)."""

    sleeps = (0.0, 0.15)


class NoisyKernel(SleepyKernel):
    """Fast once, then 50 ms slower on every timed step: no two steps agree."""

    sleeps = (0.0, 0.0, *([0.05] * 10))


def test_a_burst_of_load_does_not_decide(cache, monkeypatch):
    """The backends take turns and keep their fastest step: one slow step (another job) cannot make
    the faster kernel lose, and the verdict is cached."""
    monkeypatch.setattr(autotune, "STEADY", math.inf)  # caching must not depend on this machine's load
    choice = choose({KernelBackend.FBGEMM: BurstKernel, KernelBackend.TORCH: SlowKernel})
    assert choice.backend is KernelBackend.FBGEMM and choice.source == "measured"
    assert choice.seconds["fbgemm"] < 0.02 < choice.seconds["torch"]
    assert json.loads(cache.read_text()) == {next(iter(json.loads(cache.read_text()))): choice.seconds}


def test_an_undeclared_pooling_is_timed_over_a_range(cache, monkeypatch):
    """No pooling factors declared: each backend is timed at 1, 4 and 16 ids per bag and scored by the
    geometric mean, so a kernel that wins only at 1 id per bag (the old assumption) does not win the run.
    The verdict is cached under its own key."""
    monkeypatch.setattr(autotune, "STEADY", math.inf)
    timed: list[float] = []

    def fake_time(classes, tables, feature_table, optim, *, pooled, device, kjt):
        pooling = kjt.lengths().double().mean().item()  # ~ the workload's pooling (0..2x per bag)
        timed.append(pooling)
        # torch: 1.0 ms flat; fbgemm: 0.2 ms per id per bag (wins below 5, loses above)
        return {"torch": [1e-3] * 3, "fbgemm": [2e-4 * pooling] * 3}

    monkeypatch.setattr(autotune, "time_backends", fake_time)
    run = lambda workload: autotune.choose_kernel(  # noqa: E731
        KernelBackend.AUTO, BOTH, {KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding},
        SPECS, [0, 1], OPTIM, pooled=True, device=torch.device("cpu"), workload=workload,
    )  # fmt: skip
    assert run(Workload(batch_size=16, pooling=1.0)).backend is KernelBackend.FBGEMM
    assert run(Workload(batch_size=16, pooling=16.0)).backend is KernelBackend.TORCH
    timed.clear()
    undeclared = run(Workload(batch_size=16, pooling=None))
    assert timed == pytest.approx([1, 4, 16], rel=0.3)  # bags of 0..2x the pooling: the sample mean
    fbgemm = (2e-4**3 * timed[0] * timed[1] * timed[2]) ** (1 / 3)
    assert undeclared.seconds == pytest.approx({"torch": 1e-3, "fbgemm": fbgemm})
    assert undeclared.backend is (KernelBackend.FBGEMM if fbgemm < 1e-3 else KernelBackend.TORCH)
    keys = list(json.loads(cache.read_text()))
    assert any("| pooling undeclared 1,4,16" in k for k in keys) and len(keys) == 3


def test_a_noisy_measurement_is_used_but_not_cached(cache):
    choice = choose({KernelBackend.FBGEMM: NoisyKernel, KernelBackend.TORCH: SlowKernel})
    assert choice.backend is KernelBackend.FBGEMM and choice.source == "measured"
    assert not cache.exists()  # the next run times again
    assert autotune.steady([0.010, 0.012, 0.5]) and not autotune.steady([0.010, 0.020, 0.021])


def test_cache_off_times_every_time(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.CACHE_ENV, "off")
    assert autotune.cache_dir() is None
    calls = []
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: calls.append(1) or {"fbgemm": 2.0, "torch": 1.0})
    for _ in range(2):
        assert choose({KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding}).backend is (
            KernelBackend.TORCH
        )
    assert len(calls) == 2
    monkeypatch.delenv(autotune.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert autotune.cache_dir() == tmp_path / "lightning_shardrec"


def test_a_pinned_kernel_is_honoured(cache, monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a pinned kernel is never timed")

    monkeypatch.setattr(autotune, "measure", no_timing)
    classes = {KernelBackend.FBGEMM: TorchBatchedEmbedding, KernelBackend.TORCH: SlowKernel}
    pinned = choose(classes, kernel=KernelBackend.TORCH)
    assert pinned.backend is KernelBackend.TORCH and pinned.label() == "torch (pinned)"
    monkeypatch.setenv(autotune.PIN_ENV, "TORCH")
    assert choose(classes).backend is KernelBackend.TORCH
    monkeypatch.setenv(autotune.PIN_ENV, "cuda")
    with pytest.raises(ValueError, match="unknown kernel 'cuda'; available: auto, fbgemm, torch"):
        choose(classes)
    # make_kernel builds what was pinned
    monkeypatch.setenv(autotune.PIN_ENV, "torch")
    built = kernels.make_kernel(SPECS, [0, 1], OPTIM, pooled=True, device="cpu")
    assert built.backend is KernelBackend.TORCH


def test_only_runnable_backends_are_timed(cache, monkeypatch):
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: pytest.fail("one candidate needs no timing"))
    why = "fbgemm needs embedding dims divisible by 4, got [6]"
    only = choose({KernelBackend.FBGEMM: SlowKernel, KernelBackend.TORCH: TorchBatchedEmbedding},
                  runnable={KernelBackend.FBGEMM: why, KernelBackend.TORCH: None})  # fmt: skip
    assert only.backend is KernelBackend.TORCH and only.label() == f"torch (only: {why})"


def test_cuda_without_fbgemm_cuda_kernels_falls_back_to_torch(monkeypatch):
    """Issue 23: an fbgemm build with no CUDA kernels must not be picked for CUDA tables."""
    monkeypatch.setattr(kernels, "fbgemm_available", lambda: True)
    monkeypatch.setattr(kernels, "fbgemm_ops_on", lambda device: device == "cpu")
    cuda = torch.device("cuda")
    reasons = kernels.runnable(cuda, OPTIM, [8])
    assert reasons == {KernelBackend.FBGEMM: "the installed fbgemm_gpu has no CUDA kernels", KernelBackend.TORCH: None}
    assert kernels.choose_backend("auto", cuda, OPTIM, [8]) is KernelBackend.TORCH
    choice = kernels.choose(SPECS, [0, 1], OPTIM, pooled=True, device=cuda)
    assert choice.backend is KernelBackend.TORCH
    assert choice.label() == "torch (only: the installed fbgemm_gpu has no CUDA kernels)"


def test_timing_leaves_the_rng_alone(cache):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    kernels.choose(SPECS, [0, 1], OPTIM, pooled=True, device="cpu", workload=WORK)
    assert torch.equal(torch.get_rng_state(), before)


def _agree_worker(rank, world, cache_dir):
    """:func:`_agree` with the environment restored after it: the rank processes serve later cases (left at
    ``off``, the kernel cache made every later ``kernel="auto"`` on these ranks time its backends again)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ):
        return _agree(rank, world, cache_dir)


def _agree(rank, world, cache_dir):
    import os

    from lightning_shardrec.distributed.comm.collectives import ShardingEnv, sum_over_ranks

    os.environ[autotune.CACHE_ENV] = os.path.join(cache_dir, f"rank{rank}")
    os.environ.pop(autotune.PIN_ENV, None)
    env = ShardingEnv.from_process_group()

    def agree(local, names):
        return dict(zip(names, sum_over_ranks([local[n] for n in names], env), strict=True))

    # alone, rank 0 would pick fbgemm and rank 1 torch; summed, torch is faster for the group
    rigged = [{"fbgemm": 1.0, "torch": 3.0}, {"fbgemm": 5.0, "torch": 1.0}][rank]
    real_measure = autotune.measure
    autotune.measure = lambda *a, **k: rigged
    try:
        classes = {KernelBackend.FBGEMM: TorchBatchedEmbedding, KernelBackend.TORCH: TorchBatchedEmbedding}
        alone = choose(classes).backend
        os.environ[autotune.CACHE_ENV] = "off"
        together = choose(classes, agree=agree)
        # a rank holding no shard of the group still joins, and gets the group's choice
        empty = autotune.choose_kernel(
            KernelBackend.AUTO, BOTH, classes, SPECS if rank else [], [0, 1] if rank else [], OPTIM, pooled=True,
            device=torch.device("cpu"), workload=WORK, agree=agree,
        )  # fmt: skip
    finally:
        autotune.measure = real_measure
    # through a real sharded collection: every rank's groups end on the same backends
    from lightning_shardrec.configs import EmbeddingBagConfig
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.modules import EmbeddingBagCollection
    from lightning_shardrec.planner import (
        EmbeddingComputeKernel,
        ParameterSharding,
        ShardingPlan,
        ShardingType,
        ShardMetadata,
    )

    configs = [EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name=n, feature_names=[n]) for n in ("t0", "t1")]
    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(configs)
    fused = EmbeddingComputeKernel.FUSED
    rows = [ShardMetadata((0, 0), (25, 8), 0), ShardMetadata((25, 0), (15, 8), 1)]
    plan = {
        "t0": ParameterSharding(ShardingType.ROW_WISE, fused, [0, 1], rows),
        "t1": ParameterSharding(ShardingType.TABLE_WISE, fused, [0], [ShardMetadata((0, 0), (40, 8), 0)]),
    }
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"ebc": plan}), embedding_optimizer=OPTIM)
    groups = [g for g in dmp.sharded["ebc"].groups if g.fused]
    assert all(g.kernel is None or g.kernel.backend is g.kernel_choice.backend for g in groups)
    real = [g.kernel_choice.backend for g in groups]
    return alone, together.backend, together.seconds, empty.backend, real


def test_all_ranks_agree(tmp_path):
    results = run_ranks(_agree_worker, 2, str(tmp_path))
    assert [r[0] for r in results] == [KernelBackend.FBGEMM, KernelBackend.TORCH]
    assert [r[1] for r in results] == [KernelBackend.TORCH, KernelBackend.TORCH]
    assert results[0][2] == results[1][2] == {"fbgemm": 6.0, "torch": 4.0}
    # rank 0 held nothing (empty timings); rank 1's figures alone decide
    assert [r[3] for r in results] == [KernelBackend.TORCH, KernelBackend.TORCH]
    assert results[0][4] == results[1][4] and len(results[0][4]) == 2


def test_verdicts_hold_for_one_build_of_the_torch_kernels_loops(monkeypatch):
    """A verdict timed on the torch kernel's tensor ops (no compiled loops) is never read back for the loops."""
    from lightning_shardrec.kernels import native

    key = lambda device: autotune.cache_key(SPECS, 2, OPTIM, True, torch.device(device), WORK)  # noqa: E731
    with_loops = key("cpu")
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert key("cpu") != with_loops and key("cpu").endswith("| torch tensor ops")
    assert "torch loops" not in key("meta") and "tensor ops" not in key("meta")
    monkeypatch.delenv(native.NATIVE_ENV)
    assert key("cpu") == with_loops and with_loops.endswith(f"| torch loops {native.source_key()}")
