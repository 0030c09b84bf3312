"""``DenseReplicas``: the dense rest of a sharded model, data-parallel, one plain object per strategy.

The layers that are not sharded tables train in ``DistributedDataParallel`` on a process group
of their own (DDP's hook-driven all-reduces never interleave with the tables' collectives),
with the fused tables left out (they are updated in backward). Where the tables' collectives
use the same-host transport, the dense all-reduce goes through it too. This object also keeps
every process group the strategy made, and destroys them at teardown (their threads stop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.distributed.comm.groups import live_group
from lightning_shardrec.distributed.comm.same_host import use_shm_allreduce
from lightning_shardrec.distributed.comm.transport import Transport
from lightning_shardrec.lightning.failures.teardown import destroy_groups
from lightning_shardrec.lightning.parameters.fused_params import fused_names
from lightning_shardrec.lightning.parameters.tables import ShardedTables


class DenseReplicas:
    """``new_group()`` makes a process group (collective) like the strategy's default one; ``allreduce_hook``
    registers the transport's all-reduce on a DDP wrapper (default ``use_shm_allreduce``)."""

    def __init__(
        self,
        new_group: Callable[[], dist.ProcessGroup],
        allreduce_hook: Callable[[Any, dist.ProcessGroup], Transport | None] = use_shm_allreduce,
    ) -> None:
        self.new_group = new_group
        self.allreduce_hook = allreduce_hook
        self.groups: list[dist.ProcessGroup] = []  # every group made for this strategy (destroyed in destroy)
        self.pg: dist.ProcessGroup | None = None  # DDP's; a repeated fit reuses it
        self.transport: Transport | None = None  # the DDP hook's (closed with its wrapper)

    def wrap(
        self, tables: ShardedTables, model: torch.nn.Module, device_ids: list[int] | None, **ddp_kwargs: Any
    ) -> torch.nn.Module:
        """``model`` in ``DistributedDataParallel`` without ``tables``' fused parameters; ``model`` itself
        where nothing else trains."""
        fused = fused_names(tables.sharded)
        skip = set(fused)
        if not any(p.requires_grad for n, p in model.named_parameters() if n not in skip):
            return model
        compat.ddp_ignore(model, fused)
        pg = self.pg if self.pg is not None and live_group(self.pg) else self.own(self.new_group())
        self.pg = pg
        ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=pg, **ddp_kwargs)
        if next(iter(tables.sharded.values())).env.transport is not None:  # every rank alike
            self.transport = self.allreduce_hook(ddp, pg)
        return ddp

    def own(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """``group``, destroyed with the others in :meth:`destroy`."""
        self.groups.append(group)
        return group

    def unwrap(self) -> None:
        """The DDP wrapper is dropped: its transport closes (the next fit connects another)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def destroy(self) -> None:
        """Destroy every group made (not after a failure: a group may hold work for a dead peer)."""
        destroy_groups(self.groups)
        self.groups, self.pg = [], None
