"""The user's optimizers, seen from the embedding tables (plain functions, no Trainer).

``configure_optimizers`` stays as the user wrote it. These helpers find which param
group trained each table, derive the fused optimizer from it (SGD -> sgd,
Adagrad -> adagrad, Adam/AdamW -> row-sparse adam/adamw, same hyper-parameters),
and take the table parameters out so the dense optimizer never allocates state
for them. :func:`rule_gap` says where the fused rule differs from what the user's
optimizer does to a table in one process (the fit-start report and ``strict_optimizer``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig


def _sgd(group: dict[str, Any]) -> FusedOptimConfig:
    _no_maximize("SGD", group)
    if group.get("momentum", 0) or group.get("nesterov", False):
        raise ValueError(
            f"SGD with momentum={group.get('momentum')} has no fused row-sparse form; pass "
            "ShardRecStrategy(embedding_optimizer=...) (e.g. 'rowwise_adagrad') for the tables"
        )
    return FusedOptimConfig(optimizer=EmbOptimType.SGD, lr=group["lr"], weight_decay=group.get("weight_decay", 0.0))


def _adagrad(group: dict[str, Any]) -> FusedOptimConfig:
    _no_maximize("Adagrad", group)
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
        _no_maximize(kind.value, group)
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


def _no_maximize(name: str, group: dict[str, Any]) -> None:
    if group.get("maximize", False):
        raise ValueError(
            f"{name}(maximize=True) has no fused form (the fused tables descend); negate the loss instead, or pass "
            "ShardRecStrategy(embedding_optimizer=...) for the tables"
        )


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


Holder = tuple[torch.optim.Optimizer, dict[str, Any]]


def add_params(holder: Holder, params: list[nn.Parameter]) -> None:
    """Append ``params`` to the holder's param group, with the state the optimizer's constructor would give them.

    Some optimizers make their state in the constructor only (``torch.optim.Adagrad`` up to torch 2.12 makes
    ``sum`` there and reads it in ``step``); a parameter appended later would fail its first step. A throwaway
    optimizer of the same class over the group's settings makes that state; a lazy optimizer makes none.
    """
    opt, group = holder
    group["params"].extend(params)
    try:
        fresh = cast(Any, type(opt))([{**group, "params": list(params)}])
    except Exception:  # a constructor that needs more than a param group: its own step must make the state
        return
    for p in params:
        if p in fresh.state and p not in opt.state:
            opt.state[p] = fresh.state[p]


_LAZY_ADAM = (
    "row-sparse ('lazy') {name}: a row a batch does not touch keeps its weight and moments, while torch.optim.{name} "
    "decays every row's moments and keeps moving every row that has any; the two agree after one step and differ "
    "from the second on (lazy Adam is torch.optim.SparseAdam's rule and TorchRec's fused Adam)"
)


def rule_gap(holder: Holder | None, config: FusedOptimConfig, explicit: bool) -> str | None:
    """How the fused ``config`` trains a table unlike ``holder``'s optimizer in one process; None: exactly alike.

    ``explicit``: ``config`` came from ``embedding_optimizer``/``embedding_lr`` rather than
    from the optimizer. Exact: plain SGD and Adagrad (no weight decay), whose update of a row
    with a zero gradient is zero, so updating only the touched rows changes nothing.
    """
    if holder is None:
        return (
            "no optimizer of configure_optimizers holds the tables' parameters: one process would not train them, "
            f"the fused optimizer trains them with '{config.optimizer.value}'"
        )
    opt, group = holder
    name = type(opt).__name__
    try:
        derived: FusedOptimConfig | None = derive_fused_config(
            opt, {**group, "lr": group.get("initial_lr", group["lr"])}
        )
    except ValueError:
        derived = None
    if explicit and config != derived:
        return f"embedding_optimizer/embedding_lr set the tables' rule to {describe(config)}, not {name}'s"
    if config.optimizer in (EmbOptimType.ADAM, EmbOptimType.ADAMW):
        return _LAZY_ADAM.format(name="AdamW" if config.optimizer is EmbOptimType.ADAMW else "Adam")
    if config.weight_decay:
        return (
            f"weight_decay={config.weight_decay} decays only the rows a batch touches; torch.optim.{name} decays "
            "every row at every step"
        )
    return None


def describe(config: FusedOptimConfig) -> str:
    """``'adam' (lr=0.01, eps=1e-08, betas=(0.9, 0.999), weight_decay=0.0)``: the hyper-parameters the rule reads."""
    parts = [f"lr={config.lr}"]
    if config.optimizer is not EmbOptimType.SGD:
        parts.append(f"eps={config.eps}")
    if config.optimizer in (EmbOptimType.ADAM, EmbOptimType.ADAMW):
        parts.append(f"betas=({config.beta1}, {config.beta2})")
    parts.append(f"weight_decay={config.weight_decay}")
    return f"'{config.optimizer.value}' ({', '.join(parts)})"


def rule_report(
    holder: Holder | None, config: FusedOptimConfig, explicit: bool, fused: list[str], dense: list[str], strict: bool
) -> str:
    """The fit-start line: which update rule each table gets and how it differs; raises under ``strict``."""
    gap = rule_gap(holder, config, explicit) if fused else None
    given = explicit or holder is None
    source = "given by embedding_optimizer" if given else f"derived from {type(holder[0]).__name__}"  # type: ignore[index]
    lines = []
    if fused:
        how = "exact: each row moves as in one process" if gap is None else f"differs from one process: {gap}"
        lines.append(f"fused tables {fused} train with {describe(config)} {source}; {how}")
    if dense:
        owner = "the dense optimizer" if holder is None else type(holder[0]).__name__
        lines.append(f"data-parallel tables {dense} train in {owner} itself (exact)")
    if gap is not None and strict:
        raise ValueError(
            f"ShardRecStrategy(strict_optimizer=True): fused tables {fused} would train with {describe(config)}, "
            f"which {gap}. Train the tables with SGD or Adagrad without weight_decay (exact), or drop strict_optimizer"
        )
    return "ShardRecStrategy: " + "; ".join(lines)


def group_slot(optimizers: list[torch.optim.Optimizer], holder: Holder | None) -> tuple[int, int] | None:
    """(optimizer index, group index) of ``holder``, to find the same group in a later fit."""
    if holder is None:
        return None
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            if opt is holder[0] and group is holder[1]:
                return i, j
    return None


def group_at(optimizers: list[torch.optim.Optimizer], slot: tuple[int, int] | None) -> Holder | None:
    """The param group at ``slot`` (see :func:`group_slot`), if the optimizers still have one there."""
    if slot is None or slot[0] >= len(optimizers) or slot[1] >= len(optimizers[slot[0]].param_groups):
        return None
    opt = optimizers[slot[0]]
    return opt, opt.param_groups[slot[1]]
