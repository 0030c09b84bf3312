"""The same-host shared-memory transport (``comm_transport``): ``shm`` (the all-to-alls and
reductions through ``/dev/shm``), ``connect`` (setting it up, collectively, or falling back
to the process group) and ``allreduce_hook`` (DDP's gradient all-reduce through it)."""

from lightning_shardrec.distributed.transport.connect import attach, parse_transport
from lightning_shardrec.distributed.transport.shm import ShmTransport

__all__ = ["ShmTransport", "attach", "parse_transport"]
