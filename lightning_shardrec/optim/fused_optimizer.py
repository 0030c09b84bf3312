"""``FusedOptimizer``: the in-backward embedding optimizer seen as a ``torch.optim.Optimizer``.

The rows were already updated inside backward, so ``step()`` only runs the
closure. What the object adds is the *interface*: ``param_groups`` (an LR
scheduler that edits ``lr`` reaches the kernels, which read this very dict; or, linked with
:meth:`FusedOptimizer.link_lr`, the tables' lr follows another optimizer's param group),
``state`` (views of the kernels' momentum / adagrad sums) and
``state_dict()``/``load_state_dict()`` for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.kernels import BatchedEmbeddingKernel
from lightning_shardrec.kernels.base import hparams_from


class FusedOptimizer(torch.optim.Optimizer):
    """One param group over every table weight of ``kernels``; state per table."""

    def __init__(self, kernels: Sequence[BatchedEmbeddingKernel], config: FusedOptimConfig) -> None:
        self.kernels = list(kernels)
        self.config = config
        self.table_names: list[str] = [t.name for k in self.kernels for t in k.tables]
        params: list[Tensor] = [w for k in self.kernels for w in k.split_weights()]
        if not params:  # a rank that owns no table still has a group for schedulers
            params = [torch.empty(0)]
        super().__init__(params, hparams_from(config))
        self._lr_source: _LrSource | None = None
        self._bind()

    def link_lr(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Make the tables' lr follow param group ``index`` of ``optimizer`` (its LR scheduler).

        At every read: ``lr = base x group['lr'] / group['initial_lr']``, where ``base`` is this
        optimizer's configured lr (``embedding_lr``, else the group's lr as configured) and
        ``initial_lr`` is what LR schedulers record in the group (without one, e.g. under
        ``ReduceLROnPlateau``, the group's lr as of now). The group is looked up in
        ``optimizer.param_groups`` at each read, so it survives ``optimizer.load_state_dict``
        (which replaces the group dicts), e.g. on ``fit(ckpt_path=...)``.
        """
        group = optimizer.param_groups[index]
        self._lr_source = _LrSource(optimizer, index, float(group.get("initial_lr", group["lr"])))
        self._bind()

    def _linked_lr(self, base: float) -> float:
        """The tables' lr now: ``base`` scaled as the linked group's lr is (see :meth:`link_lr`)."""
        source = self._lr_source
        if source is None:
            return base
        group = source.optimizer.param_groups[source.index]
        initial = float(group.get("initial_lr", source.configured))
        return base * float(group["lr"]) / initial if initial else base

    def _views(self) -> list[dict[str, Tensor]]:
        return [s for k in self.kernels for s in k.split_states()]

    def _bind(self) -> None:
        """Point kernels at our param group and ``state`` at the kernels' tensors."""
        group = self.param_groups[0]
        hparams: Any = group if self._lr_source is None else _LinkedLr(self, group)
        for k in self.kernels:
            k.hparams = hparams
        for p, views in zip(group["params"], self._views(), strict=False):
            self.state[p] = views

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Runs ``closure`` (once) if given; rows were updated in its backward."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: fused tables never hold a ``.grad``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "param_groups", None):
            raise ValueError("FusedOptimizer has one param group (the kernels' tables); it cannot take more")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters and copy each table's state into the kernels in place."""
        saved = state_dict.get("state", {})
        if len(state_dict.get("param_groups", [])) != 1:
            raise ValueError("FusedOptimizer state_dict must have exactly one param group")
        num = len(self.param_groups[0]["params"])
        if len(state_dict["param_groups"][0]["params"]) != num:
            raise ValueError(
                f"FusedOptimizer state_dict is for {len(state_dict['param_groups'][0]['params'])} tables, "
                f"this optimizer has {num} ({self.table_names})"
            )
        views = self._views()
        super().load_state_dict(state_dict)
        for i, dst in enumerate(views):
            src = saved.get(i, {})
            for name, tensor in dst.items():
                if name not in src:
                    raise ValueError(f"table '{self.table_names[i]}': optimizer state '{name}' missing in state_dict")
                if tuple(src[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"table '{self.table_names[i]}': state '{name}' has shape {tuple(src[name].shape)}, "
                        f"expected {tuple(tensor.shape)}"
                    )
                tensor.copy_(src[name])
        self._bind()


@dataclass(frozen=True)
class _LrSource:
    """The param group the tables' lr follows: ``optimizer.param_groups[index]``, read live."""

    optimizer: torch.optim.Optimizer
    index: int
    #: the group's lr when linked, for schedulers that record no ``initial_lr``
    configured: float


class _LinkedLr(dict):  # type: ignore[type-arg]
    """The fused param group, but ``lr`` scaled live as the linked group's (see ``link_lr``)."""

    def __init__(self, owner: FusedOptimizer, group: dict[str, Any]) -> None:
        super().__init__(group)
        self._owner = owner
        self._base = float(owner.config.lr)

    def __getitem__(self, key: str) -> Any:
        if key == "lr":
            lr = self._owner._linked_lr(self._base)
            self._owner.param_groups[0]["lr"] = lr  # keep the visible group (and checkpoints) in step
            return lr
        return super().__getitem__(key)
