"""TorchRec's fx tracer at its path (``torchrec.fx.tracer``): ``Tracer(leaf_modules=...)`` and ``symbolic_trace``.

``torch.fx.symbolic_trace`` already traces the collections here (``modules/fx_trace.py``); this tracer
adds TorchRec's ``leaf_modules``: modules whose class name is listed stay one ``call_module`` node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class Tracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that keeps modules whose class name is in ``leaf_modules`` as leaves (TorchRec's)."""

    def __init__(self, leaf_modules: Sequence[str] | None = None) -> None:
        super().__init__()
        self._leaf_modules = list(leaf_modules or [])

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m).__name__ in self._leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(
    root: nn.Module | Any,
    concrete_args: dict[str, Any] | None = None,
    leaf_modules: Sequence[str] | None = None,
) -> torch.fx.GraphModule:
    """``root`` traced by :class:`Tracer` into a ``GraphModule`` (TorchRec's signature)."""
    tracer = Tracer(leaf_modules)
    graph = tracer.trace(root, concrete_args)
    name = root.__class__.__name__ if isinstance(root, nn.Module) else root.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)


__all__ = ["Tracer", "symbolic_trace"]
