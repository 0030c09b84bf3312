"""TorchRec's ``optim.warmup.WarmupOptimizer`` and ``optim.clipping.GradientClippingOptimizer``.

Checked side by side with TorchRec 1.8 on CPU (same model, seed and batches): the warmup's lr at every step of
the five-stage schedule below and the weights after 18 SGD steps are equal, and so are the clipped weights and
``last_total_grad_norm`` for NORM (2 and inf), VALUE and NONE. The expectations here are those runs' values,
and formulas from TorchRec's definitions.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.optim.clipping import GradientClipping, GradientClippingOptimizer
from lightning_shardrec.optim.keyed import KeyedOptimizerWrapper
from lightning_shardrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

#: the lr before each of 18 steps, as TorchRec 1.8 sets it for these stages
TORCHREC_LRS = [0.01, 0.04, 0.07, 0.1, 0.025, 0.025, 0.0125, 0.08, 0.04, 0.1, 0.0027777778, 0.0006944444, 0.0,
                0.05, 0.07, 0.09, 0.1, 0.1]  # fmt: skip


def _stages() -> list[WarmupStage]:
    return [
        WarmupStage(WarmupPolicy.LINEAR, max_iters=3, value=0.1),
        WarmupStage(WarmupPolicy.STEP, max_iters=6, value=0.5, decay_iters=2),
        WarmupStage(WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=9, value=0.2, sgdr_period=3),
        WarmupStage(WarmupPolicy.POLY, max_iters=12, value=2.0),
        WarmupStage(WarmupPolicy.INTERPOLATE, max_iters=15, value=0.3, start_interpolating_iters=12, end_value=0.9),
    ]


def _sgd(lin: torch.nn.Module, lr: float = 0.1) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(dict(lin.named_parameters()), lambda p: torch.optim.SGD(p, lr=lr))


def test_warmup_sets_torchrecs_lr_at_every_step_and_resumes_from_its_state() -> None:
    lin = torch.nn.Linear(4, 2)
    opt = WarmupOptimizer(_sgd(lin), _stages(), lr=0.1)
    lrs = []
    for step in range(18):
        lin.weight.grad, lin.bias.grad = torch.ones_like(lin.weight), torch.ones_like(lin.bias)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if step == 10:
            saved = opt.state_dict()
    assert lrs == pytest.approx(TORCHREC_LRS, abs=1e-9)
    assert saved["state"]["__warmup"]["warmup"].tolist() == [11, 3]  # the iteration and stage, saved by name
    resumed = WarmupOptimizer(_sgd(lin), _stages(), lr=0.1)
    assert resumed.param_groups[0]["lr"] == pytest.approx(0.01)  # stage 0 at iteration 0, before loading
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == pytest.approx(TORCHREC_LRS[11], abs=1e-9)


def test_warmup_refuses_stages_out_of_order_or_incomplete() -> None:
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="stage 1 .LINEAR. has max_iters=3; it must be greater than the previous"):
        WarmupOptimizer(_sgd(lin), [WarmupStage(max_iters=5), WarmupStage(max_iters=3)])
    with pytest.raises(ValueError, match="stage 0 .INTERPOLATE. needs start_interpolating_iters and end_value"):
        WarmupOptimizer(_sgd(lin), [WarmupStage(WarmupPolicy.INTERPOLATE, max_iters=5)])
    late = WarmupStage(WarmupPolicy.INTERPOLATE, max_iters=5, start_interpolating_iters=5, end_value=1.0)
    with pytest.raises(ValueError, match=r"max_iters \(5\) must be greater than start_interpolating_iters \(5\)"):
        WarmupOptimizer(_sgd(lin), [late])
    with pytest.raises(ValueError, match="stage 0: sgdr_period must be >= 1, got 0"):
        WarmupOptimizer(_sgd(lin), [WarmupStage(WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, 5, sgdr_period=0)])


@pytest.mark.parametrize(
    ("clipping", "norm_type", "track"),
    [(GradientClipping.NORM, 2.0, False), (GradientClipping.NORM, "inf", False),
     (GradientClipping.VALUE, 2.0, True), (GradientClipping.NONE, 2.0, True)],
)  # fmt: skip
def test_clipping_clips_the_dense_gradients_as_torch_does(clipping, norm_type, track) -> None:
    torch.manual_seed(1)
    lin, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    opt = GradientClippingOptimizer(_sgd(lin, 0.5), clipping, max_gradient=0.3, norm_type=norm_type,
                                    track_grad_norm=track)  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        x = torch.randn(5, 4)
        for m in (lin, ref):
            m.zero_grad()
            (m(x) ** 2).sum().backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], float(norm_type))
        if clipping == GradientClipping.NORM:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3, float(norm_type))
        elif clipping == GradientClipping.VALUE:
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.3)
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.last_total_grad_norm, norm)
    torch.testing.assert_close(lin.weight, ref.weight)
    assert math.isfinite(float(opt.last_total_grad_norm))


def test_clipping_refuses_sharded_parameter_groups_and_bad_bounds() -> None:
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(UnsupportedFeatureError, match="param_to_pgs=...\\): parameters sharded over process groups"):
        GradientClippingOptimizer(_sgd(lin), GradientClipping.NORM, enable_global_grad_clip=True,
                                  param_to_pgs={lin.weight: [object()]})  # type: ignore[dict-item]  # fmt: skip
    with pytest.raises(ValueError, match="max_gradient must be > 0, got 0"):
        GradientClippingOptimizer(_sgd(lin), GradientClipping.NORM, max_gradient=0)
    assert GradientClippingOptimizer(_sgd(lin)).last_total_grad_norm is None  # no step yet


def _fused_tables_follow(rank: int, world: int) -> bool:
    # TorchRec's pattern: WarmupOptimizer(CombinedOptimizer([dmp.fused_optimizer, dense])): the fused tables'
    # in-backward updates use the warmed-up lr (checked against setting the same lrs by hand each step)
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from lightning_shardrec.distributed.model_parallel import DistributedModelParallel
    from lightning_shardrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from lightning_shardrec.distributed.types import ShardingPlan
    from lightning_shardrec.optim.keyed import CombinedOptimizer

    def run(warm: bool) -> torch.Tensor:
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])],
            device=torch.device("meta"),
        )
        plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t": row_wise()}, world_size=world)})
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, embedding_optimizer="sgd")
        stages = [WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.25)]
        opt = WarmupOptimizer(CombinedOptimizer([dmp.fused_optimizer]), stages, lr=0.4) if warm else None
        for step in range(5):
            if not warm:
                lr = 0.4 * (0.25 + 0.75 * min(step, 4) / 4) if step <= 4 else 0.4
                for group in dmp.fused_optimizer.param_groups:
                    group["lr"] = lr
            kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([rank + step, 7]), lengths=torch.tensor([2]))
            dmp(kjt).values().pow(2).sum().backward()
            if opt is not None:
                opt.step()
        saved = opt.state_dict()["state"]["__warmup"]["warmup"].tolist() if opt is not None else [5, 1]
        assert saved == [5, 1]  # the warmup's place, saved under a CombinedOptimizer too (iteration 5, stage 1)
        return dmp.state_dict()["embedding_bags.t.weight"].local_shards()[0].tensor.clone()

    return torch.equal(run(True), run(False))


def test_warmup_drives_the_fused_tables_lr():
    from lightning_shardrec.testing import run_ranks

    assert run_ranks(_fused_tables_follow, 2) == [True, True]
