"""Row-sparse optimizer updates: only the rows a batch touched are read and written.

Each rule takes ``weight [R, D]``, the touched ``rows [U]`` (unique), their summed
gradient ``grad [U, D]``, the table's state tensors and the hyper-parameters,
and updates weight and state in place. Formulas follow ``torch.optim`` (SGD,
Adagrad, Adam, AdamW) so a row that is touched moves exactly as torch would move
it; untouched rows do not move (the "lazy" row-sparse semantics).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.configs import EmbOptimType

State = dict[str, Tensor]
Rule = Callable[[Tensor, Tensor, Tensor, State, Mapping[str, Any]], None]


def init_state(optimizer: EmbOptimType, rows: int, dim: int, device: torch.device | str) -> State:
    """Zero optimizer state for a ``[rows, dim]`` table (names as torch.optim uses them)."""
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
    return {
        EmbOptimType.SGD: lambda: {},
        EmbOptimType.ADAGRAD: lambda: {"sum": zeros(rows, dim)},
        EmbOptimType.ROWWISE_ADAGRAD: lambda: {"sum": zeros(rows)},
        EmbOptimType.ADAM: lambda: {"exp_avg": zeros(rows, dim), "exp_avg_sq": zeros(rows, dim)},
        EmbOptimType.ADAMW: lambda: {"exp_avg": zeros(rows, dim), "exp_avg_sq": zeros(rows, dim)},
    }[optimizer]()


def _with_l2(weight: Tensor, rows: Tensor, grad: Tensor, hp: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    w = weight.index_select(0, rows)
    wd = hp["weight_decay"]
    return w, (grad + wd * w if wd else grad)


def _sgd(weight: Tensor, rows: Tensor, grad: Tensor, state: State, hp: Mapping[str, Any]) -> None:
    w, g = _with_l2(weight, rows, grad, hp)
    weight.index_copy_(0, rows, w - hp["lr"] * g)


def _adagrad(weight: Tensor, rows: Tensor, grad: Tensor, state: State, hp: Mapping[str, Any]) -> None:
    w, g = _with_l2(weight, rows, grad, hp)
    s = state["sum"].index_select(0, rows).addcmul_(g, g)
    state["sum"].index_copy_(0, rows, s)
    weight.index_copy_(0, rows, w.addcdiv_(g, s.sqrt_().add_(hp["eps"]), value=-hp["lr"]))


def _rowwise_adagrad(weight: Tensor, rows: Tensor, grad: Tensor, state: State, hp: Mapping[str, Any]) -> None:
    w, g = _with_l2(weight, rows, grad, hp)
    s = state["sum"].index_select(0, rows) + g.pow(2).mean(1)
    state["sum"].index_copy_(0, rows, s)
    scale = hp["lr"] / (s.sqrt() + hp["eps"])
    weight.index_copy_(0, rows, w - scale.unsqueeze(1) * g)


def _adam_like(decoupled: bool) -> Rule:
    def rule(weight: Tensor, rows: Tensor, grad: Tensor, state: State, hp: Mapping[str, Any]) -> None:
        lr, b1, b2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
        w = weight.index_select(0, rows)
        if decoupled:
            g = grad
            if wd:
                w.mul_(1.0 - lr * wd)
        else:
            g = grad + wd * w if wd else grad
        step = float(state["step"])  # incremented once per backward, before the rules run
        m = state["exp_avg"].index_select(0, rows).mul_(b1).add_(g, alpha=1 - b1)
        v = state["exp_avg_sq"].index_select(0, rows).mul_(b2).addcmul_(g, g, value=1 - b2)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        bias1, bias2 = 1 - b1**step, 1 - b2**step
        denom = (v.sqrt() / bias2**0.5).add_(eps)
        weight.index_copy_(0, rows, w.addcdiv_(m, denom, value=-lr / bias1))

    return rule


RULES: dict[EmbOptimType, Rule] = {
    EmbOptimType.SGD: _sgd,
    EmbOptimType.ADAGRAD: _adagrad,
    EmbOptimType.ROWWISE_ADAGRAD: _rowwise_adagrad,
    EmbOptimType.ADAM: _adam_like(decoupled=False),
    EmbOptimType.ADAMW: _adam_like(decoupled=True),
}

USES_STEP = frozenset({EmbOptimType.ADAM, EmbOptimType.ADAMW})


def accumulate_rows(ids: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """Sum per-id gradients ``[N, D]`` into unique rows: ``(rows [U], grad [U, D])``."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    summed = grad.new_zeros(rows.numel(), grad.shape[1]).index_add_(0, inverse, grad)
    return rows, summed
