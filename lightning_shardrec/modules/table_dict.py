"""``TableDict``: an ``nn.ModuleDict`` keyed by table name that takes any name.

``nn.ModuleDict`` refuses a key that is an attribute of the class (a table named
``items``, ``keys``, ``values``, ``update`` or ``pop`` fails with torch's
``KeyError: "attribute 'items' already exists"``). Tables are registered straight in
``_modules``, which is what ``state_dict``, ``load_state_dict``, ``named_parameters``
and ``.to()`` read, so a table's keys are ``embedding_bags.<name>.weight`` whatever
its name. Read a table as ``d[name]`` (``d.items`` stays the method).
"""

from __future__ import annotations

from torch import Tensor, nn


class TableDict(nn.ModuleDict):
    """Table name -> module, for any table name (see the module docstring)."""

    def __setitem__(self, key: str, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"TableDict: table {key!r} must be an nn.Module, got {type(module).__name__}")
        self._modules[key] = module  # not add_module: it rejects names of ModuleDict's methods

    def weight(self, name: str) -> Tensor:
        """Table ``name``'s ``weight`` (``[rows, dim]``; quantized tables: their stored rows)."""
        weight = getattr(self._modules[name], "weight", None)
        if not isinstance(weight, Tensor):
            raise TypeError(f"TableDict: table {name!r} has no weight tensor")
        return weight
