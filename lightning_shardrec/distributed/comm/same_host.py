"""The opt-in same-host shared-memory transport, resolved by name: the core never imports it.

``comm_transport="auto"`` / ``"shm"`` (or ``$LIGHTNING_SHARDREC_TRANSPORT``) asks for
:mod:`lightning_shardrec.distributed.transport`; these functions import it when called and hand back what the
collectives accept (a :class:`~.transport.Transport` on the ``ShardingEnv``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as dist

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.transport import Transport

#: the opt-in same-host transport's package (imported by name, on first use)
SAME_HOST = "lightning_shardrec.distributed.transport"


def _same_host(module: str) -> Any:
    return importlib.import_module(f"{SAME_HOST}.{module}")


def attach_transport(env: ShardingEnv, mode: str | None = None, timeout: float | None = None) -> ShardingEnv:
    """Collective over ``env.pg``: ``env`` with the same-host transport ``mode`` asks for (see
    :func:`lightning_shardrec.distributed.transport.connect.attach`), else ``env`` itself."""
    attach = _same_host("connect").attach
    return attach(env, mode, timeout)  # type: ignore[no-any-return]


def use_shm_allreduce(ddp: Any, pg: dist.ProcessGroup) -> Transport | None:
    """Collective over ``pg``: DDP's gradient all-reduce through shared memory where every rank (or every host's
    ranks) can share it; returns the transport (the caller closes it), or None where DDP keeps its own."""
    return _same_host("allreduce_hook").use_shm_allreduce(ddp, pg)  # type: ignore[no-any-return]


def transport_report(env: ShardingEnv) -> str:
    """Collective over ``env.pg``: the hosts the plan assumed and the transport each host got."""
    return _same_host("per_host").transport_report(env)  # type: ignore[no-any-return]
