"""``RowWiseAdagrad``: Adagrad with one accumulator per row (TorchRec's ``torchrec.optim.rowwise_adagrad``).

For a ``[rows, D]`` parameter with gradient ``g``::

    sum[r]  += mean(g[r] ** 2)                      one float per row
    w[r]    -= lr * g[r] / (sqrt(sum[r]) + eps)

Named in ``apply_optimizer_in_backward`` on a table, it selects the fused
``rowwise_adagrad`` rule (the same arithmetic, inside backward); on a dense
parameter it runs as a plain ``torch.optim.Optimizer``. 1-D parameters keep one
accumulator per element, as TorchRec's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


class RowWiseAdagrad(torch.optim.Optimizer):
    """``RowWiseAdagrad(params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10)``."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        **unused: Any,
    ) -> None:
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay), ("eps", eps)):
            if not value >= 0.0:
                raise ValueError(f"RowWiseAdagrad: {name} must be >= 0, got {value}")
        if unused:
            raise TypeError(f"RowWiseAdagrad got unexpected arguments {sorted(unused)}")
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    shape = (p.shape[0],) if p.dim() > 1 else tuple(p.shape)
                    state["step"] = torch.zeros(())
                    init = float(group["initial_accumulator_value"])
                    state["sum"] = torch.full(shape, init, dtype=p.dtype, device=p.device)
                state["step"] += 1
                if group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                clr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
                if p.dim() > 1:
                    state["sum"].add_(grad.square().mean(dim=tuple(range(1, p.dim()))))
                    std = state["sum"].sqrt().add_(group["eps"]).view(-1, *([1] * (p.dim() - 1)))
                else:
                    state["sum"].addcmul_(grad, grad)
                    std = state["sum"].sqrt().add_(group["eps"])
                p.addcdiv_(grad, std, value=-clr)
        return loss
