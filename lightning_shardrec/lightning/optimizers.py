"""The user's optimizers, seen from the embedding tables (plain functions, no Trainer).

``configure_optimizers`` stays as the user wrote it. These helpers find which param
group trained each table, derive the fused optimizer from it (SGD -> sgd,
Adagrad -> adagrad, Adam/AdamW -> row-sparse adam/adamw, same hyper-parameters),
and take the table parameters out so the dense optimizer never allocates state
for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig


def _sgd(group: dict[str, Any]) -> FusedOptimConfig:
    if group.get("momentum", 0) or group.get("nesterov", False):
        raise ValueError(
            f"SGD with momentum={group.get('momentum')} has no fused row-sparse form; pass "
            "ShardRecStrategy(embedding_optimizer=...) (e.g. 'rowwise_adagrad') for the tables"
        )
    return FusedOptimConfig(optimizer=EmbOptimType.SGD, lr=group["lr"], weight_decay=group.get("weight_decay", 0.0))


def _adagrad(group: dict[str, Any]) -> FusedOptimConfig:
    odd = {k: group[k] for k in ("lr_decay", "initial_accumulator_value") if group.get(k, 0)}
    if odd:
        raise ValueError(
            f"Adagrad with {odd} has no fused form; use the defaults (0) or pass "
            "ShardRecStrategy(embedding_optimizer=...) for the tables"
        )
    return FusedOptimConfig(
        optimizer=EmbOptimType.ADAGRAD, lr=group["lr"], eps=group["eps"], weight_decay=group.get("weight_decay", 0.0)
    )


def _adam(kind: EmbOptimType):  # type: ignore[no-untyped-def]
    def derive(group: dict[str, Any]) -> FusedOptimConfig:
        if group.get("amsgrad", False):
            raise ValueError("Adam(amsgrad=True) has no fused form; pass ShardRecStrategy(embedding_optimizer=...)")
        b1, b2 = group["betas"]
        return FusedOptimConfig(
            optimizer=kind,
            lr=group["lr"],
            eps=group["eps"],
            beta1=b1,
            beta2=b2,
            weight_decay=group.get("weight_decay", 0.0),
        )

    return derive


_DERIVE = {
    torch.optim.SGD: _sgd,
    torch.optim.Adagrad: _adagrad,
    torch.optim.Adam: _adam(EmbOptimType.ADAM),
    torch.optim.AdamW: _adam(EmbOptimType.ADAMW),
    torch.optim.SparseAdam: _adam(EmbOptimType.ADAM),  # its rule is row-sparse ("lazy") Adam exactly
}


def derive_fused_config(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> FusedOptimConfig:
    """The fused optimizer that trains tables as ``optimizer``'s ``group`` would."""
    derive = _DERIVE.get(type(optimizer))
    if derive is None:
        names = ", ".join(c.__name__ for c in _DERIVE)
        raise ValueError(
            f"cannot derive a fused embedding optimizer from {type(optimizer).__name__} (derivable: {names}); "
            f"pass ShardRecStrategy(embedding_optimizer=...) with one of: {', '.join(o.value for o in EmbOptimType)}"
        )
    return derive(group)


def find_group(
    optimizers: list[torch.optim.Optimizer], params: Iterable[nn.Parameter]
) -> tuple[torch.optim.Optimizer, dict[str, Any]] | None:
    """The (optimizer, param group) that holds the first of ``params``, if any does."""
    wanted = {id(p) for p in params}
    for opt in optimizers:
        for group in opt.param_groups:
            if any(id(p) in wanted for p in group["params"]):
                return opt, group
    return None


def remove_params(optimizers: list[torch.optim.Optimizer], params: Iterable[nn.Parameter]) -> None:
    """Take ``params`` out of every param group and drop their state (groups stay, for schedulers)."""
    gone = {id(p) for p in params}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in gone]
        for p in [p for p in opt.state if id(p) in gone]:
            del opt.state[p]
