"""16-mixed, a table looked up twice per step, 2 ranks: equal to Lightning's own DDP on 2 ranks, bit for bit.

Why DDP and not one process: under ``precision="16-mixed"`` each rank's scaled gradients come
from its half of the batch, so an fp16 overflow (and the GradScaler's skipped step) can happen
on 2 ranks where one process over the whole batch has none. Measured on this model (4 steps,
Adagrad lr 0.1): the one-process run keeps the scale at 16384 at step 4, while both 2-rank runs
(``strategy="ddp"`` and ``"shardrec"``) skip that step and halve it to 8192, so both end 0.1 (one
Adagrad step, lr x sign) away from one process in every parameter, the dense layer's too. The
sharded run equals DDP exactly, scale history included (docs/lightning_features.md, precision).
"""

from __future__ import annotations

import lightning as L
import torch
from _models import external_launch
from test_repeated_lookups import MODELS, fit_options, loader, trainer

from lightning_shardrec.testing import run_ranks


class Scales(L.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen.append(float(trainer.precision_plugin.scaler.get_scale()))


def fit_fp16(rank, world, strategy_name):
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    model, scales = MODELS["plain"](), Scales()
    strategy = ShardRecStrategy(kernel="torch") if strategy_name == "shardrec" else "ddp"
    t = trainer(strategy=strategy, devices=world, callbacks=[scales], **fit_options(True))
    t.fit(model, loader(rank, world))
    state = t.strategy.full_state_dict() if strategy_name == "shardrec" else model.state_dict()
    return {k: v.clone() for k, v in state.items()}, scales.seen


def test_two_tower_in_16_mixed_on_two_ranks_equals_ddp():
    (ddp, ddp_scales), _ = run_ranks(fit_fp16, 2, "ddp", timeout=600)
    (sharded, sharded_scales), _ = run_ranks(fit_fp16, 2, "shardrec", timeout=600)
    assert sharded_scales == ddp_scales == [32768.0, 32768.0, 16384.0, 8192.0]  # step 4 skipped on 2 ranks
    assert set(sharded) == set(ddp)
    for k, v in ddp.items():
        torch.testing.assert_close(sharded[k], v, rtol=0, atol=0, msg=k)
