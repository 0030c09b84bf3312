"""What the user's optimizer sees of the tables before they are sharded: shapes, not memory.

``configure_optimizers`` runs before sharding (the fused optimizer is derived from the
param group that holds the tables). ``torch.optim.Adagrad`` allocates its state in its
constructor, so an optimizer built over CPU-built tables would allocate a second copy of
every whole table (``[rows, dim]`` of ``sum``) just before they are sharded and dropped.
:func:`tables_hidden` swaps each real table weight for a ``meta`` placeholder of the same
shape while the optimizers are built, then puts the real weights back in the modules and
the param groups (state made for a placeholder is dropped; none was allocated). A later fit
(the model sharded already) hides the fused kernels' weights the same way::

    with tables_hidden(collections.values(), lambda: strategy.optimizers):
        strategy.setup_optimizers(trainer)   # Adagrad's "sum" for a table: meta, 0 bytes
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def tables_hidden(
    modules: Iterable[nn.Module], optimizers: Callable[[], list[torch.optim.Optimizer]]
) -> Iterator[None]:
    """Inside: every non-meta parameter of ``modules`` (unsharded collections, fused groups of sharded
    ones) is a ``meta`` placeholder of its shape; on exit the modules get their weights back and so do
    the optimizers ``optimizers()`` returns, without state for any table (a failed setup then tears
    down without moving meta state)."""
    modules = list(modules)
    real = {id(p): p for c in modules for p in c.parameters() if p.device.type != "meta"}
    stand_in = {pid: nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for pid, p in real.items()}
    slots = [
        (m, name, pid)
        for c in modules
        for m in c.modules()
        for name, p in m._parameters.items()
        if p is not None and (pid := id(p)) in real
    ]
    for m, name, pid in slots:
        m._parameters[name] = stand_in[pid]
    try:
        yield
    finally:
        for m, name, pid in slots:
            m._parameters[name] = real[pid]
        back = {id(s): real[pid] for pid, s in stand_in.items()}
        tables = {id(p) for c in modules for p in c.parameters()} | set(back)  # tables built on meta too
        for opt in optimizers() if tables else []:
            for group in opt.param_groups:
                group["params"] = [back.get(id(p), p) for p in group["params"]]
            for p in [p for p in opt.state if id(p) in tables]:
                del opt.state[p]  # meta state (Adagrad's "sum"); the fused optimizer keeps the real one


def has_meta_tables(module: nn.Module | None) -> bool:
    """Whether ``module`` still holds tables on ``meta`` (a setup that failed before sharding them)."""
    return module is not None and any(p.device.type == "meta" for p in module.parameters())
