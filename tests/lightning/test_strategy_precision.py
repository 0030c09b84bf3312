"""Precision plugins with sharded tables (issue 23 items 1 and 4), on CPU/gloo.

``"16-mixed"`` runs through Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin with its
CPU ``GradScaler`` (``Trainer(precision="16-mixed")`` on CPU would turn into bf16-mixed):
the same scaler logic as on CUDA. Not run here: CUDA autocast (``test_16_mixed_on_cuda``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

STEPS = 4
BATCH = 6  # per rank
LOSS_OVERFLOW_AT = 1  # the scaled loss overflows in fp16: dense and table gradients are inf
TABLE_OVERFLOW_AT = 2  # only the gradient reaching the tables is inf: the dense one is finite
# 16-mixed sharded vs 16-mixed on one device: fp16 autocast of the MLP, batch split in two
MIXED_TOL = {"rtol": 1e-4, "atol": 5e-5}  # measured: 1.3e-5 on mlp.weight, tables <= 1e-8
# 16-mixed vs fp32: fp16 rounding of the MLP's activations and gradients (4 steps, lr 0.05)
FP32_TOL = {"rtol": 0.0, "atol": 1e-3}  # measured: sgd 6e-6, adagrad 1.8e-4


class OverflowRec(Rec):
    """``Rec`` whose loss overflows at chosen steps (its value unchanged at the table-only one)."""

    def __init__(self, overflow: bool, optimizer: str = "adagrad") -> None:
        super().__init__(optimizer)
        self.overflow = overflow

    def training_step(self, batch, i):
        if not self.overflow:
            return super().training_step(batch, i)
        emb = self.ebc(batch.sparse).values()
        loss = F.binary_cross_entropy_with_logits(self.mlp(torch.cat([batch.dense, emb], 1)).squeeze(1), batch.labels)
        if i == LOSS_OVERFLOW_AT:
            loss = loss * 1e30
        if i == TABLE_OVERFLOW_AT:  # d loss / d emb = 1e36 (inf once scaled); forward value ~unchanged
            loss = loss + (emb * 1e36).sum() - (emb * 1e36).sum().detach()
        return loss


def precision_options(precision: str) -> dict:
    if precision == "16-mixed":
        from lightning.pytorch.plugins.precision import MixedPrecision

        return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return {"precision": precision}


def fit_sharded(rank, world, precision, overflow=True, optimizer="adagrad"):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    kinds = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "column_wise"}  # every table fused
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
    strategy = ShardRecStrategy(kernel="torch", constraints=constraints)
    t = trainer(strategy=strategy, devices=world, max_steps=STEPS, **precision_options(precision))
    model = OverflowRec(overflow, optimizer)
    t.fit(model, data(BATCH, STEPS))
    kernels = [k for s in strategy.sharded.values() for k in s.kernels()]
    dtypes = {
        str(t.dtype) for k in kernels for t in [*k.split_weights(), *(v for s in k.split_states() for v in s.values())]
    }
    scaler = getattr(t.precision_plugin, "scaler", None)
    scale = None if scaler is None else scaler.get_scale()
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    skipped = None if strategy._scaler_glue is None else strategy._scaler_glue.updates.skipped_steps
    return state, dtypes, str(model.mlp.weight.dtype), scale, skipped


def fit_reference(world, precision, overflow=True, optimizer="adagrad"):
    model = OverflowRec(overflow, optimizer)
    t = trainer(devices=1, max_steps=STEPS, **precision_options(precision))
    t.fit(model, data(BATCH * world, STEPS))
    scaler = getattr(t.precision_plugin, "scaler", None)
    return model.state_dict(), None if scaler is None else scaler.get_scale()


def test_16_mixed_unscales_table_updates_and_skips_overflow_steps():
    """Against 16-mixed on one device (tables as plain parameters under the scaler): equal,
    including a loss overflow (dense and tables inf) and a table-only overflow (the scaler
    learns it from the tables): both steps skipped on every rank, no NaN, scale backed off."""
    results = run_ranks(fit_sharded, 2, "16-mixed")
    mixed, mixed_scale = fit_reference(2, "16-mixed")
    assert mixed_scale == 65536.0 / 4  # backed off once per overflow step
    for state, dtypes, dense_dtype, scale, skipped in results:
        assert dtypes == {"torch.float32"} and dense_dtype == "torch.float32"
        assert scale == mixed_scale and skipped == 2
        for k in mixed:
            assert torch.isfinite(state[k]).all(), k
            torch.testing.assert_close(state[k], mixed[k], **MIXED_TOL, msg=f"16-mixed vs one device: {k}")


def test_16_mixed_tracks_fp32():
    """Without overflow, 16-mixed sgd tables end within fp16 rounding of an fp32 run (a scaled
    gradient would move them 65536 times too far; adagrad would hide it: see the test above)."""
    results = run_ranks(fit_sharded, 2, "16-mixed", False, "sgd")
    fp32, _ = fit_reference(2, "32-true", False, "sgd")
    for state, *_ in results:
        for k in fp32:
            torch.testing.assert_close(state[k], fp32[k], **FP32_TOL, msg=f"sgd 16-mixed vs fp32: {k}")


def test_bf16_true_casts_only_the_dense_part():
    """Tables and their Adagrad sums stay fp32 (their config's dtype); the MLP trains in bf16."""
    results = run_ranks(fit_sharded, 2, "bf16-true")
    fp32, _ = fit_reference(2, "32-true")
    for state, dtypes, dense_dtype, _, _ in results:
        assert dtypes == {"torch.float32"} and dense_dtype == "torch.bfloat16"
        for k in fp32:
            if "ebc." in k:
                assert state[k].dtype == torch.float32, k
                torch.testing.assert_close(state[k], fp32[k], rtol=0.0, atol=3e-2, msg=k)


def fit_on_cuda(sharded: bool):  # pragma: no cover - GPU only
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    kinds = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "column_wise"}
    options: dict = {"accelerator": "gpu", "devices": 1, "max_steps": STEPS, "precision": "16-mixed"}
    if sharded:
        constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
        options["strategy"] = ShardRecStrategy(constraints=constraints)
    model = OverflowRec(True, "sgd")
    t = trainer(**options)
    t.fit(model, data(BATCH, STEPS))
    state = t.strategy.full_state_dict() if sharded else model.state_dict()
    return {k: v.detach().cpu() for k, v in state.items()}, t.precision_plugin.scaler.get_scale()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast and its GradScaler need a GPU")
def test_16_mixed_on_cuda():  # pragma: no cover - GPU only
    """CUDA autocast + GradScaler: the sharded run (kernel "auto") equals the plain one."""
    got, got_scale = fit_on_cuda(True)
    want, want_scale = fit_on_cuda(False)
    assert got_scale == want_scale
    for k in want:
        assert torch.isfinite(got[k]).all(), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-4, msg=k)
