"""Optimizers over named parameters, at TorchRec's path (``torchrec.optim.keyed``).

* :class:`KeyedOptimizerWrapper` ``(params: {name: tensor}, optim_factory)``: the optimizer the
  factory builds over ``params.values()``, with the names kept for ``params`` and ``state_dict()``.
* :class:`CombinedOptimizer` ``([opt, (prefix, opt), ...])``: one optimizer stepping several,
  e.g. ``CombinedOptimizer([dmp.fused_optimizer, dense_opt])``.

Both are ``torch.optim.Optimizer``s whose ``param_groups`` are the wrapped optimizers' own
dicts, so an LR scheduler on the wrapper reaches them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer whose parameters have names: ``params`` (name -> tensor), state dicts keyed by name."""

    params: dict[str, Tensor]
    _inner: torch.optim.Optimizer

    def _adopt(self, inner: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> None:
        self._inner = inner
        self.params = dict(params)
        super().__init__(inner.param_groups, inner.defaults)  # the very group dicts: schedulers reach inner
        self.state = inner.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: state}, "param_groups": [{..., "params": [names]}]}``."""
        name_of = {id(t): n for n, t in self.params.items()}
        inner = self._inner.state_dict()
        ordered = [p for g in self._inner.param_groups for p in g["params"]]
        state = {name_of[id(ordered[i])]: s for i, s in inner["state"].items()}
        groups = [{**g, "params": [name_of[id(ordered[i])] for i in g["params"]]} for g in inner["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict` (names must be this optimizer's, in its groups)."""
        ordered = [p for g in self._inner.param_groups for p in g["params"]]
        name_of = {id(t): n for n, t in self.params.items()}
        index = {name_of[id(p)]: i for i, p in enumerate(ordered)}
        missing = sorted(set(state_dict["state"]) - set(index))
        if missing:
            raise KeyError(f"KeyedOptimizer.load_state_dict: unknown parameter names {missing}; known: {sorted(index)}")
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state_dict["param_groups"]]
        self._inner.load_state_dict(
            {"state": {index[n]: s for n, s in state_dict["state"].items()}, "param_groups": groups}
        )


class KeyedOptimizerWrapper(KeyedOptimizer):
    """``KeyedOptimizerWrapper(params, optim_factory)``: ``optim_factory(list(params.values()))``, keyed by name."""

    def __init__(
        self, params: Mapping[str, Tensor], optim_factory: Callable[[list[Tensor]], torch.optim.Optimizer]
    ) -> None:
        self._adopt(optim_factory(list(params.values())), params)


class CombinedOptimizer(torch.optim.Optimizer):
    """Steps every optimizer of ``optims`` (each an optimizer or ``(prefix, optimizer)``)."""

    def __init__(self, optims: Sequence[torch.optim.Optimizer | tuple[str, torch.optim.Optimizer]]) -> None:
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        for i, item in enumerate(optims):
            prefix, opt = item if isinstance(item, tuple) else ("", item)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"CombinedOptimizer: item {i} is {type(opt).__name__}, not a torch.optim.Optimizer")
            self.optimizers.append((prefix, opt))
        groups = [g for _, o in self.optimizers for g in o.param_groups]
        super().__init__(groups, {})
        self.state = _CombinedState(self.optimizers)  # type: ignore[assignment]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{key: optimizer.state_dict()}``, key the prefix (or the position when there is none)."""
        return {self._key(i): opt.state_dict() for i, (_, opt) in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        keys = [self._key(i) for i in range(len(self.optimizers))]
        if sorted(state_dict) != sorted(keys):
            raise KeyError(f"CombinedOptimizer.load_state_dict: got keys {sorted(state_dict)}, expected {keys}")
        for key, (_, opt) in zip(keys, self.optimizers, strict=True):
            opt.load_state_dict(state_dict[key])

    def _key(self, i: int) -> str:
        return self.optimizers[i][0] or str(i)


class _CombinedState(dict):  # type: ignore[type-arg]
    """Every wrapped optimizer's state, looked up by parameter."""

    def __init__(self, optimizers: list[tuple[str, torch.optim.Optimizer]]) -> None:
        super().__init__()
        for _, opt in optimizers:
            self.update(opt.state)


__all__ = ["CombinedOptimizer", "KeyedOptimizer", "KeyedOptimizerWrapper"]
