"""Optimizers over named parameters, at TorchRec's path (``torchrec.optim.keyed``).

* :class:`KeyedOptimizerWrapper` ``(params: {name: tensor}, optim_factory)``: the optimizer the
  factory builds over ``params.values()``, with the names kept for ``params`` and ``state_dict()``.
* :class:`CombinedOptimizer` ``([opt, (prefix, opt), ...])``: one optimizer stepping several,
  e.g. ``CombinedOptimizer([dmp.fused_optimizer, dense_opt])``.

Both are ``torch.optim.Optimizer``s whose ``param_groups`` are the wrapped optimizers' own
dicts, so an LR scheduler on the wrapper reaches them.
"""

import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Collection, List, Mapping, Optional, Set, Tuple, Union

import torch
from torch import Tensor

from lightning_shardrec._compat.torch import is_sharded_tensor, sharded_tensor_type

if TYPE_CHECKING:
    from lightning_shardrec._compat.torch import ShardedTensor
else:  # torch's (a sharded table in a keyed optimizer's ``params``, as in TorchRec)
    ShardedTensor = sharded_tensor_type()


class KeyedOptimizer(torch.optim.Optimizer):
    """``KeyedOptimizer(params, state, param_groups)``: an optimizer whose parameters have names.

    ``params`` maps names to tensors; ``state`` and ``param_groups`` are the live objects of the
    optimizer that does the work (TorchRec's constructor). ``state_dict()`` is keyed by name.
    """

    def __init__(
        self,
        params: Mapping[str, Union[torch.Tensor, ShardedTensor]],
        state: Mapping[Any, Any],
        param_groups: Collection[Mapping[str, Any]],
    ) -> None:
        known = {id(t) for t in params.values()}
        strays = [k for k in state if id(k) not in known] if isinstance(state, dict) else []  # combined: checked inside
        if strays:
            names = [
                k if isinstance(k, str) else f"{type(k).__name__} {tuple(getattr(k, 'shape', ()))}" for k in strays
            ]
            raise ValueError(f"KeyedOptimizer: All state keys must be params. Not among params: {names}")
        # Optimizer.__init__ sets up what every optimizer has (hooks, step profiling, defaults); it
        # refuses an empty list, so it gets one empty group, then the live state and groups replace its own
        super().__init__([{"params": []}], {"_save_param_groups": False})
        self._bind(params, state, param_groups)
        self._bound = True

    def _bind(
        self, params: Mapping[str, Tensor], state: Mapping[Any, Any], groups: Collection[Mapping[str, Any]]
    ) -> None:
        self.params = dict(params)
        self.state = state  # type: ignore[assignment]
        self.param_groups = groups  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:  # torch's keeps only defaults, state and groups: keep all
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's
        raise NotImplementedError(f"{type(self).__name__}.step: use KeyedOptimizerWrapper or CombinedOptimizer")

    def add_param_group(self, param_group: Any) -> None:
        if not getattr(self, "_bound", False):  # ``Optimizer.__init__``'s placeholder group, before the live ones
            return super().add_param_group(param_group)
        raise NotImplementedError(f"{type(self).__name__}.add_param_group: add the group to the wrapped optimizer")

    def init_state(self, sparse_grad_parameter_names: Optional[Set[str]] = None) -> None:
        """Create the optimizer state now: zero gradients (sparse for the named ones), then one step.

        As TorchRec: the step runs with zero gradients, so stateless rules (and Adagrad) leave the
        values unchanged; rules with a bias correction or decay may move them.
        """
        names = sparse_grad_parameter_names or set()
        for name, p in self.params.items():
            if not p.requires_grad or p.grad is not None:
                continue
            if name in names:
                dims = p.shape[0]
                p.grad = torch.sparse_coo_tensor(
                    torch.empty(1, 0, dtype=torch.long, device=p.device),
                    torch.empty(0, *p.shape[1:], device=p.device, dtype=p.dtype),
                    (dims, *p.shape[1:]),
                )
            else:
                p.grad = torch.zeros_like(p)
        self.step(closure=None)

    def save_param_groups(self, save: bool) -> None:
        """Whether :meth:`state_dict` includes the param groups (TorchRec's switch; off by default)."""
        self.defaults["_save_param_groups"] = save

    def _ordered(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: state}, "param_groups": [{..., "params": [names]}]}``.

        As TorchRec's: nested dicts of a state are walked, and a state object with a ``state_dict()``
        method (not a tensor) is saved as what that returns.
        """
        name_of = {id(t): n for n, t in self.params.items()}
        state = {name_of[id(p)]: _saved_form(s) for p, s in self.state.items() if id(p) in name_of}
        groups = [{**g, "params": [name_of[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`: state tensors copied per name, hyper-parameters per group.

        As TorchRec's: nested dicts are loaded into the live ones, a state object with a
        ``load_state_dict()`` method loads its entry, a ``ShardedTensor`` copies shard by shard.
        """
        unknown = sorted(set(state_dict["state"]) - set(self.params))
        if unknown:
            raise KeyError(
                f"KeyedOptimizer.load_state_dict: unknown parameter names {unknown}; known: {sorted(self.params)}"
            )
        for name, saved in state_dict["state"].items():
            _load_into(self._live_state(self.params[name]), saved, name)
        for group, saved in zip(self.param_groups, state_dict.get("param_groups", []), strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _live_state(self, param: Tensor) -> dict[str, Any]:
        """The optimizer's own state dict of ``param`` (created empty when it has none yet)."""
        if param not in self.state:
            self.state[param] = {}  # type: ignore[index]
        return self.state[param]  # type: ignore[no-any-return]

    def post_load_state_dict(self) -> None:
        """Hook run after :meth:`load_state_dict` (nothing to do here)."""


class KeyedOptimizerWrapper(KeyedOptimizer):
    """``KeyedOptimizerWrapper(params, optim_factory)``: ``optim_factory(list(params.values()))``, keyed by name."""

    def __init__(
        self, params: Mapping[str, Tensor], optim_factory: Callable[[list[Tensor]], torch.optim.Optimizer]
    ) -> None:
        self._optimizer = optim_factory(list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._optimizer.zero_grad(set_to_none)


class OptimizerWrapper(KeyedOptimizer):
    """``OptimizerWrapper(optimizer)``: a ``KeyedOptimizer`` passing every call to ``optimizer`` (TorchRec's
    base for wrappers such as gradient clipping; subclasses override what they change)."""

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        self._optimizer = optimizer
        super().__init__(optimizer.params, optimizer.state, optimizer.param_groups)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)
        self._bind(self._optimizer.params, self._optimizer.state, self._optimizer.param_groups)  # the new objects
        self.post_load_state_dict()

    def post_load_state_dict(self) -> None:
        self._optimizer.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        self._optimizer.save_param_groups(save)


class CombinedOptimizer(KeyedOptimizer):
    """Steps every optimizer of ``optims`` (each an optimizer or ``(prefix, optimizer)``).

    ``params`` are ``"<prefix>.<name>"`` (the prefix left out when empty); an optimizer that is not
    keyed (``DistributedModelParallel.fused_optimizer``) names its tables, or ``param_<i>``.
    ``state_dict()`` is TorchRec's: ``{"state": {name: state}, "param_groups": [...]}`` over those names.
    """

    def __init__(self, optims: List[Union[KeyedOptimizer, Tuple[str, KeyedOptimizer]]]) -> None:
        self._optims: list[tuple[str, torch.optim.Optimizer]] = []
        for i, item in enumerate(optims):
            prefix, opt = item if isinstance(item, tuple) else ("", item)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"CombinedOptimizer: item {i} is {type(opt).__name__}, not a torch.optim.Optimizer")
            self._optims.append((prefix, opt))
        super().__init__({}, _CombinedState(self._optims), [])

    def _bind(
        self, params: Mapping[str, Tensor], state: Mapping[Any, Any], groups: Collection[Mapping[str, Any]]
    ) -> None:
        self.state = state  # type: ignore[assignment]  # params and param_groups: the wrapped optimizers', live

    @property
    def optimizers(self) -> list[tuple[str, torch.optim.Optimizer]]:
        return self._optims

    @property
    def params(self) -> dict[str, Tensor]:  # type: ignore[override]
        return {self.prepend_opt_key(n, k): p for k, o in self._optims for n, p in _named(o).items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for _, o in self._optims for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Only ``Optimizer.__init__`` assigns (its placeholder list): the wrapped optimizers' groups stay the truth."""

    @staticmethod
    def prepend_opt_key(name: str, opt_key: str) -> str:
        """``"<opt_key>.<name>"`` (either alone when the other is empty), as TorchRec."""
        return f"{opt_key}.{name}" if opt_key and name else opt_key or name

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # TorchRec's signature
        """Run ``closure`` once (it computes the gradients), then step every optimizer."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        for _, opt in self._optims:
            opt.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for _, opt in self._optims:
            opt.zero_grad(set_to_none)

    def save_param_groups(self, save: bool) -> None:
        super().save_param_groups(save)
        for _, opt in self._optims:
            if isinstance(opt, KeyedOptimizer):
                opt.save_param_groups(save)

    def post_load_state_dict(self) -> None:
        for _, opt in self._optims:
            if isinstance(opt, KeyedOptimizer):
                opt.post_load_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """TorchRec's layout (:meth:`state_dict` is KeyedOptimizer's over :attr:`params`): each parameter's
        state is loaded into its optimizer's live state, the groups into the optimizers' groups, in place."""
        super().load_state_dict(state_dict)
        self.post_load_state_dict()

    def _live_state(self, param: Tensor) -> dict[str, Any]:
        for _, opt in self._optims:
            if any(p is param for g in opt.param_groups for p in g["params"]):
                if param not in opt.state:
                    opt.state[param] = {}
                return opt.state[param]  # type: ignore[no-any-return]
        raise KeyError(f"CombinedOptimizer: parameter of shape {tuple(param.shape)} is in none of the optimizers")


def _saved_form(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _saved_form(v)
        elif not isinstance(v, Tensor) and callable(getattr(v, "state_dict", None)):
            out[k] = v.state_dict()
        else:
            out[k] = v
    return out


def _load_into(mine: dict[str, Any], saved: Mapping[str, Any], where: str) -> None:
    """Load ``saved`` into the live state ``mine`` in place (``where``: the path, for errors)."""
    for k, v in saved.items():
        cur = mine.get(k)
        if isinstance(cur, dict) and isinstance(v, Mapping):
            _load_into(cur, v, f"{where}.{k}")
        elif cur is not None and not isinstance(cur, Tensor) and callable(getattr(cur, "load_state_dict", None)):
            cur.load_state_dict(v)
        elif is_sharded_tensor(cur) and is_sharded_tensor(v):
            mine_shards, new_shards = cur.local_shards(), v.local_shards()
            if len(mine_shards) != len(new_shards):
                raise ValueError(
                    f"KeyedOptimizer.load_state_dict: state '{where}.{k}' has {len(new_shards)} local shards, "
                    f"this optimizer's has {len(mine_shards)}"
                )
            for shard, new in zip(mine_shards, new_shards, strict=True):
                shard.tensor.detach().copy_(new.tensor)
        elif isinstance(cur, Tensor) and isinstance(v, Tensor):
            cur.detach().copy_(v)
        else:
            mine[k] = v if isinstance(v, Tensor) else copy.deepcopy(v)


def _named(opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    if isinstance(opt, KeyedOptimizer):
        return opt.params
    ordered = [p for g in opt.param_groups for p in g["params"]]
    names = getattr(opt, "table_names", None)
    if names is not None and len(names) == len(ordered):
        return dict(zip(names, ordered, strict=True))
    return {f"param_{i}": p for i, p in enumerate(ordered)}


class _CombinedState(Mapping):  # type: ignore[type-arg]
    """Every wrapped optimizer's live state, looked up by parameter."""

    def __init__(self, optimizers: list[tuple[str, torch.optim.Optimizer]]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: Any) -> Any:
        for _, opt in self._optimizers:
            if param in opt.state:
                return opt.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[Any]:
        for _, opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for _, opt in self._optimizers)


__all__ = ["CombinedOptimizer", "KeyedOptimizer", "KeyedOptimizerWrapper", "OptimizerWrapper"]
