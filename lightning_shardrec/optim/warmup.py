"""TorchRec's learning-rate warmup wrapper (``torchrec.optim.warmup``): stages of multipliers on a base lr.

::

    opt = WarmupOptimizer(
        KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1)),
        stages=[WarmupStage(WarmupPolicy.LINEAR, max_iters=100, value=0.1),
                WarmupStage(WarmupPolicy.POLY, max_iters=1000, value=2.0)],
        lr=0.1,
    )

Each ``step()`` steps the wrapped optimizer, then sets every param group's ``lr`` to ``lr * multiplier(stage,
iteration)``, with TorchRec 1.8's stages and formulas; the iteration and stage are saved and loaded with the
optimizer's state dict, under TorchRec's entry (``state["__warmup"]``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any

import torch

from lightning_shardrec.optim.keyed import KeyedOptimizer, OptimizerWrapper

logger: logging.Logger = logging.getLogger(__name__)


@unique
class WarmupPolicy(Enum):
    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    INTERPOLATE = "interpolate"


@dataclass
class WarmupStage:
    """One stage, up to iteration ``max_iters``. ``decay_iters`` (POLY's denominator, STEP's step size) defaults
    to ``max_iters`` (STEP: 1); ``start_interpolating_iters`` and ``end_value`` are INTERPOLATE's."""

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1
    start_interpolating_iters: int | None = None
    end_value: float | None = None


def _lr_stages(stages: list[WarmupStage]) -> list[WarmupStage]:
    """The stages checked, their defaults filled, and a last stage of multiplier 1 forever."""
    start = 0
    for i, stage in enumerate(stages):
        if stage.max_iters <= start:
            raise ValueError(
                f"WarmupOptimizer: stage {i} ({stage.policy.name}) has max_iters={stage.max_iters}; it must be greater "
                f"than the previous stage's max_iters ({start})"
            )
        if stage.policy == WarmupPolicy.INTERPOLATE:
            if stage.start_interpolating_iters is None or stage.end_value is None:
                raise ValueError(
                    f"WarmupOptimizer: stage {i} (INTERPOLATE) needs start_interpolating_iters and end_value"
                )
            if stage.max_iters <= stage.start_interpolating_iters:
                raise ValueError(
                    f"WarmupOptimizer: stage {i} (INTERPOLATE): max_iters ({stage.max_iters}) must be greater than "
                    f"start_interpolating_iters ({stage.start_interpolating_iters})"
                )
        if stage.policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS and stage.sgdr_period < 1:
            raise ValueError(f"WarmupOptimizer: stage {i}: sgdr_period must be >= 1, got {stage.sgdr_period}")
        start = stage.max_iters
        if stage.decay_iters <= 0:
            stage.decay_iters = 1 if stage.policy == WarmupPolicy.STEP else stage.max_iters
    return [*stages, WarmupStage(policy=WarmupPolicy.NONE, max_iters=1 << 63, value=1.0)]


def _multiplier(stage: WarmupStage, it: int) -> float:
    """TorchRec 1.8's multiplier of ``stage`` at iteration ``it`` (times the stage's ``lr_scale``)."""
    policy, value = stage.policy, stage.value
    if policy == WarmupPolicy.LINEAR:
        m = value + (1.0 - value) * it / stage.max_iters
    elif policy == WarmupPolicy.CONSTANT:
        m = value
    elif policy == WarmupPolicy.POLY:
        m = math.pow(1 - it / stage.decay_iters, value)
    elif policy == WarmupPolicy.STEP:
        m = math.pow(value, it // stage.decay_iters)
    elif policy == WarmupPolicy.INVSQRT:
        m = 1.0 / math.sqrt(it)
    elif policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:  # SGDR without the period multiplier
        m = value + (1.0 - value) * 0.5 * (1 + math.cos(math.pi * (it % stage.sgdr_period) / stage.sgdr_period))
    elif policy == WarmupPolicy.INTERPOLATE:
        start, end = float(stage.start_interpolating_iters or 0), float(stage.end_value or 0.0)
        m = value + (end - value) * (it - start) / (stage.max_iters - start)
    else:
        m = 1.0
    return m * stage.lr_scale


class WarmupOptimizer(OptimizerWrapper):
    """``WarmupOptimizer(optimizer, stages, lr=0.1, lr_param="lr", param_name="__warmup")``: see the module.

    ``state_dict()`` is the wrapped optimizer's with ``state[param_name] = {"warmup": tensor([iteration,
    stage])}`` added (TorchRec's entry), under any wrapped optimizer, a ``CombinedOptimizer`` included;
    ``load_state_dict`` takes it back out and sets the lr where the schedule was.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        stages: list[WarmupStage],
        lr: float = 0.1,
        lr_param: str = "lr",
        param_name: str = "__warmup",
    ) -> None:
        super().__init__(optimizer)
        self._stages = _lr_stages(stages)
        self._lr_param = lr_param
        self._lr = lr
        self._param_name = param_name
        self._iteration, self._stage_id = 0, 0
        self._set_lr(0, 0)  # a fused optimizer steps in the first backward, before any step()

    def _set_lr(self, it: int, stage_id: int) -> None:
        lr = self._lr * _multiplier(self._stages[stage_id], it)
        for group in self.param_groups:
            group[self._lr_param] = lr

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        warmup = {"warmup": torch.tensor([self._iteration, self._stage_id], dtype=torch.long)}
        return {**saved, "state": {**saved.get("state", {}), self._param_name: warmup}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict["state"])
        warmup = state.pop(self._param_name, None)
        self._iteration, self._stage_id = (int(v) for v in warmup["warmup"].tolist()) if warmup else (0, 0)
        super().load_state_dict({**state_dict, "state": state})  # then post_load_state_dict sets the lr

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        logger.info("WarmupOptimizer set to iteration %d", self._iteration)
        self._set_lr(self._iteration, self._stage_id)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # TorchRec's signature
        super().step(closure)
        it, stage_id = self._iteration + 1, self._stage_id
        if it > self._stages[stage_id].max_iters and stage_id + 1 < len(self._stages):
            stage_id += 1
            logger.info("WarmupOptimizer: stage %s done, now %s", self._stages[stage_id - 1], self._stages[stage_id])
        self._iteration, self._stage_id = it, stage_id
        self._set_lr(it, stage_id)


__all__ = ["WarmupOptimizer", "WarmupPolicy", "WarmupStage"]
