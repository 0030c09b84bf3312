"""The same-host shared-memory transport (``comm_transport``): ``shm`` (the all-to-alls and
reductions through ``/dev/shm``), ``connect`` (setting it up, collectively, or falling back
to the process group), ``per_host`` (shared memory inside each host, the group between hosts)
and ``allreduce_hook`` (DDP's gradient all-reduce through it).

Opt-in, at the edge: it implements :class:`~lightning_shardrec.distributed.comm.transport.Transport` and may
import comm/; nothing in the core imports it (:mod:`~lightning_shardrec.distributed.comm.same_host` resolves
it by name when ``comm_transport`` asks for it)."""

from lightning_shardrec.distributed.transport.connect import attach, parse_transport
from lightning_shardrec.distributed.transport.shm import ShmTransport

__all__ = ["ShmTransport", "attach", "parse_transport"]
