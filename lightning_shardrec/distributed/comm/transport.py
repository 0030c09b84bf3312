"""The transport protocol the collectives accept, and the ``comm_transport`` modes.

A :class:`~lightning_shardrec.distributed.comm.collectives.ShardingEnv` may carry a :class:`Transport`: its
collectives then move CPU tensors through it instead of the process group. The one implementation is the
same-host shared-memory transport (``comm_transport="auto"`` / ``"shm"``, :mod:`lightning_shardrec.distributed.
transport`), an opt-in module nothing in the core imports: :mod:`.same_host` resolves it by name when asked.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lightning_shardrec.errors import unknown_name

TRANSPORT_ENV = "LIGHTNING_SHARDREC_TRANSPORT"
TRANSPORTS = ("auto", "shm", "pg")
DEFAULT_TRANSPORT = "pg"  # chosen by measurement: docs/operations.md#same-host-communication


class Waitable(Protocol):
    """An async collective in flight: a ``dist.Work`` or a shared-memory op's handle."""

    def wait(self) -> bool: ...


class Transport(Protocol):
    """What the collectives ask of a transport: the all-to-all, the row reduce-scatter and all-gather of CPU
    tensors among ``env``'s ranks, and ``mode``, the ``comm_transport`` that attaches one again."""

    mode: str

    def all_to_all(
        self,
        out: Tensor,
        inp: Tensor,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
        wire: torch.dtype | None = None,
    ) -> Waitable: ...

    def reduce_scatter(self, x: Tensor, rows: list[int]) -> Tensor: ...

    def all_gather(self, x: Tensor, rows: list[int]) -> Tensor: ...

    def close(self) -> None: ...


def parse_transport(value: str | None, owner: str = "comm_transport") -> str | None:
    """``"auto"`` / ``"shm"`` / ``"pg"`` (any case) or None (the default), else a ``ValueError`` listing them."""
    if value is None:
        return None
    mode = str(value).lower()
    if mode not in TRANSPORTS:
        raise unknown_name(owner, value, list(TRANSPORTS))
    return mode
