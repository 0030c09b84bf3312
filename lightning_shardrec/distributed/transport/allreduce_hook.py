"""The dense layers' gradient all-reduce through shared memory: a DDP comm hook.

DDP all-reduces each gradient bucket on its process group; under gloo that is loopback TCP
worked by gloo's threads, which on a small CPU host take cores from compute. When every rank
of the dense group shares this host (:func:`~lightning_shardrec.distributed.transport.connect.connect`),
:func:`use_shm_allreduce` replaces it with :meth:`ShmTransport.all_reduce`: a reduce-scatter
(rank ``r`` sums chunk ``r`` of every rank's bucket, in rank order) and an all-gather of the
summed chunks. Every rank ends with the same bits; with 2 ranks they equal
gloo's (``a + b``), with more they may differ from gloo's in the last bit (another summation
order), as two gloo algorithms may.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_shardrec.distributed.transport.connect import connect
from lightning_shardrec.distributed.transport.per_host import HostTransport, connect_hosts
from lightning_shardrec.distributed.transport.shm import ShmTransport


def _allreduce_hook(transport: ShmTransport | HostTransport, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP's default (divide by the world size, sum) through shared memory; the process group for non-CPU buckets."""
    buf = bucket.buffer()
    buf.div_(transport.world_size)
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    if buf.device.type != "cpu":
        return dist.all_reduce(buf, group=transport.pg, async_op=True).get_future().then(lambda f: f.value()[0])
    transport.all_reduce(buf)
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects, not the strings ``from __future__ import annotations`` leaves
_allreduce_hook.__annotations__.update(bucket=dist.GradBucket, transport=ShmTransport)
_allreduce_hook.__annotations__["return"] = torch.futures.Future[Tensor]


def use_shm_allreduce(ddp: DistributedDataParallel, pg: dist.ProcessGroup) -> ShmTransport | HostTransport | None:
    """Collective over ``pg`` (DDP's group): register the shared-memory all-reduce when every rank can share
    memory, or every host's ranks can (:mod:`.per_host`: the group between hosts), and return its transport
    (the caller closes it with the DDP wrapper); None (DDP keeps its own) otherwise, on every rank alike."""
    transport: ShmTransport | HostTransport | None
    transport, _ = connect(pg)
    if transport is None:  # several hosts: shared memory inside each, the group between them
        transport, _ = connect_hosts(pg)
    if transport is not None:
        ddp.register_comm_hook(transport, _allreduce_hook)
    return transport
