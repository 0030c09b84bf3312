"""The fused tables' parameters as the user's optimizer and DDP see them.

Each sharded collection holds an *anchor*, an empty parameter: the param group a
``configure_optimizers`` puts it in is the group the fused tables train as (their lr
linked to it), also on later fits. DDP ignores the anchor and the fused groups'
parameters and buffers (the fused optimizer updates them in backward).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lightning_shardrec.distributed.sharded.collection import ShardedCollection

ANCHOR = "shardrec_anchor"  # an empty parameter per sharded collection; its param group trains the fused tables


def add_anchors(sharded: Mapping[str, ShardedCollection], device: torch.device) -> None:
    """An anchor in each collection (where a later ``configure_optimizers`` puts it = where the tables train)."""
    for coll in sharded.values():
        coll.register_parameter(ANCHOR, torch.nn.Parameter(torch.empty(0, device=device)))


def fused_params(coll: ShardedCollection) -> list[torch.nn.Parameter]:
    """The anchor and the fused groups' parameters: what leaves the user's optimizers."""
    anchor = [getattr(coll, ANCHOR)] if hasattr(coll, ANCHOR) else []
    return anchor + [p for g in coll.groups if g.fused for p in g.parameters()]


def fused_names(sharded: Mapping[str, ShardedCollection]) -> list[str]:
    """The model's names (``<path>.groups.<i>.<name>``, anchors) of what DDP must not all-reduce or broadcast."""
    names: list[str] = []
    for path, coll in sharded.items():
        for i, group in enumerate(coll.groups):
            if group.fused:
                prefix = f"{path}.groups.{i}"
                names += [n for n, _ in group.named_parameters(prefix=prefix)]
                names += [n for n, _ in group.named_buffers(prefix=prefix)]
        if hasattr(coll, ANCHOR):
            names.append(f"{path}.{ANCHOR}")
    return names
