"""TorchRec's two ways of choosing a table's fused optimizer, read into a :class:`FusedOptimConfig`.

* ``apply_optimizer_in_backward(optim_cls, params, kwargs)`` marks each table weight with
  ``_optimizer_classes`` / ``_optimizer_kwargs`` (torch's attributes); :func:`config_of_optimizer`
  maps the class and its kwargs (``torch.optim.SGD`` -> ``sgd``, ``Adagrad``, ``Adam``, ``AdamW``,
  :class:`~lightning_shardrec.optim.rowwise_adagrad.RowWiseAdagrad`).
* a sharder's ``fused_params`` dict (``{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}``);
  :func:`config_of_fused_params` maps fbgemm's keys.

Anything these carry that the fused rules would not honour (momentum, amsgrad, lr decay, a cache
setting, ...) raises :class:`UnsupportedFeatureError` naming it: never silently dropped.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.optim.rowwise_adagrad import RowWiseAdagrad

_SECTION = "see docs/migrating.md, 'Optimizers'"

#: optimizer class -> the fused rule that computes the same update
_RULE_OF_CLASS: dict[type, EmbOptimType] = {
    torch.optim.SGD: EmbOptimType.SGD,
    torch.optim.Adagrad: EmbOptimType.ADAGRAD,
    torch.optim.Adam: EmbOptimType.ADAM,
    torch.optim.AdamW: EmbOptimType.ADAMW,
    RowWiseAdagrad: EmbOptimType.ROWWISE_ADAGRAD,
}

#: kwargs that change the update in a way no fused rule does: the value the rule assumes
_NEUTRAL = {
    "momentum": 0,
    "dampening": 0,
    "nesterov": False,
    "maximize": False,
    "lr_decay": 0,
    "initial_accumulator_value": 0,
    "amsgrad": False,
    "decoupled_weight_decay": False,
}
#: implementation switches with no effect on the result
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _defaults(optimizer_class: type) -> dict[str, Any]:
    params = inspect.signature(optimizer_class).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def config_of_optimizer(optimizer_class: type, optimizer_kwargs: Mapping[str, Any], where: str) -> FusedOptimConfig:
    """The fused config that trains ``where`` (a table) as ``optimizer_class(**optimizer_kwargs)`` would."""
    rule = _RULE_OF_CLASS.get(optimizer_class)
    if rule is None:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in _RULE_OF_CLASS)
        raise UnsupportedFeatureError(
            f"{where}: optimizer {optimizer_class.__qualname__} cannot run fused inside backward; "
            f"use one of {names} ({_SECTION})"
        )
    args = {**_defaults(optimizer_class), **optimizer_kwargs}
    unknown = sorted(set(optimizer_kwargs) - set(_defaults(optimizer_class)) - {"lr"})
    if unknown:
        raise UnsupportedFeatureError(f"{where}: {optimizer_class.__qualname__} has no argument(s) {unknown}")
    for name, neutral in _NEUTRAL.items():
        if name in args and args[name] is not None and args[name] != neutral:
            raise UnsupportedFeatureError(
                f"{where}: {optimizer_class.__qualname__}({name}={args[name]!r}) is not supported by the fused "
                f"{rule.value} rule (only {name}={neutral!r}); {_SECTION}"
            )
    for name in _IMPLEMENTATION:
        if args.get(name):
            raise UnsupportedFeatureError(
                f"{where}: {optimizer_class.__qualname__}({name}={args[name]!r}) is not supported; "
                f"the fused rule picks its own implementation ({_SECTION})"
            )
    # only the arguments given pass on (as TorchRec's fused_params): fbgemm's defaults for the rest
    # (FusedOptimConfig's: Adagrad's eps is 1e-8 there, 1e-10 in torch.optim.Adagrad; lr 0.01)
    given = {k: v for k, v in optimizer_kwargs.items() if v is not None}
    fields: dict[str, Any] = {"optimizer": rule}
    for name in ("lr", "eps", "weight_decay"):
        if name in given:
            fields[name] = float(given[name])
    if "betas" in given:
        fields["beta1"], fields["beta2"] = (float(b) for b in given["betas"])
    return FusedOptimConfig(**fields)


#: fbgemm ``fused_params`` key -> FusedOptimConfig field
_FUSED_KEYS = {
    "optimizer": "optimizer",
    "learning_rate": "lr",
    "lr": "lr",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "beta1": "beta1",
    "beta2": "beta2",
}


def config_of_fused_params(fused_params: Mapping[str, Any], base: FusedOptimConfig, where: str) -> FusedOptimConfig:
    """``base`` with the fields a sharder's ``fused_params`` sets (fbgemm's key names).

    ``weight_decay_mode`` may be ``NONE``/``L2`` (added to the gradient, the rule of sgd/adagrad/adam)
    or ``DECOUPLED`` with adam (AdamW). ``stochastic_rounding`` has no effect on the float32 tables
    here and is accepted. Other keys raise, naming the key.
    """
    fields = dict(base.__dict__)
    mode = None
    for key, value in fused_params.items():
        if key in _FUSED_KEYS:
            fields[_FUSED_KEYS[key]] = EmbOptimType.parse(value) if key == "optimizer" else value
        elif key == "weight_decay_mode":
            mode = str(getattr(value, "name", value)).upper()
        elif key == "stochastic_rounding":
            continue
        else:
            accepted = sorted([*_FUSED_KEYS, "weight_decay_mode", "stochastic_rounding"])
            raise UnsupportedFeatureError(
                f"{where}: fused_params key {key!r} (= {value!r}) is not supported; accepted keys: "
                f"{', '.join(accepted)} ({_SECTION})"
            )
    if mode == "DECOUPLED" and fields["optimizer"] is EmbOptimType.ADAM:
        fields["optimizer"] = EmbOptimType.ADAMW
    elif mode not in (None, "NONE", "L2") and not (mode == "DECOUPLED" and fields["optimizer"] is EmbOptimType.ADAMW):
        raise UnsupportedFeatureError(
            f"{where}: fused_params weight_decay_mode={mode} is not supported with {fields['optimizer'].value}; "
            f"use NONE or L2 (DECOUPLED with adam) ({_SECTION})"
        )
    return FusedOptimConfig(**fields)


def in_backward_config(param: nn.Parameter, where: str) -> FusedOptimConfig | None:
    """The config ``apply_optimizer_in_backward`` attached to ``param`` (None: none attached)."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(param, "_optimizer_kwargs", [{}])
    if len(classes) != 1:
        names = [c.__qualname__ for c in classes]
        raise UnsupportedFeatureError(
            f"{where}: {len(classes)} in-backward optimizers {names} were applied; a table takes one ({_SECTION})"
        )
    return config_of_optimizer(classes[0], kwargs[0], where)
