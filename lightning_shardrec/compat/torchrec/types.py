"""TorchRec's small shared types (``torchrec.types``): ``DataType`` and the module mixins."""

from __future__ import annotations

import abc

import torch
from torch import nn

from lightning_shardrec.configs import DataType


class CacheMixin:
    """A module that caches computation and can drop it (``clear_cache()``)."""

    @abc.abstractmethod
    def clear_cache(self) -> None: ...


class CopyMixIn:
    """A module that decides how ``DistributedModelParallel`` copies it to a device."""

    @abc.abstractmethod
    def copy(self, device: torch.device) -> nn.Module: ...


class ModuleCopyMixin(CopyMixIn):
    """``copy(device)`` moves the module (``self.to(device)``)."""

    def copy(self, device: torch.device) -> nn.Module:
        return self.to(device)  # type: ignore[attr-defined,no-any-return]


class ModuleNoCopyMixin(CopyMixIn):
    """``copy(device)`` keeps the module where it is."""

    def copy(self, device: torch.device) -> nn.Module:
        return self  # type: ignore[return-value]


__all__ = ["CacheMixin", "CopyMixIn", "DataType", "ModuleCopyMixin", "ModuleNoCopyMixin"]
