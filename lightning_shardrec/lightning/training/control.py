"""One gloo group with CPU tensors for the strategy's control messages, never an NCCL communicator.

The ranks agree on a few things that are not training data: whether rank 0 received SIGTERM
(:class:`~lightning_shardrec.lightning.failures.sigterm.LaggedSigterm`, every 4th batch), whether any rank
still has a batch (:class:`~lightning_shardrec.lightning.training.uneven.BatchPadding`, every batch of an
uneven epoch) and whether rank 0 keeps the full tables after fit
(:func:`~lightning_shardrec.lightning.checkpoints.after_fit.gather_to_rank_zero`). Each is a one-element
flag the host decides. Under NCCL a flag on a device group is copied to the GPU, sent by a
communicator of its own (one more NCCL communicator: its memory, its streams, its kernels
interleaved with the data path's) and read back with ``.item()`` (a host sync). So every control
message travels on this one group instead: backend gloo, CPU tensors, made once per fit (the first
message; collective, every rank at the same point), shared by every sender, destroyed at teardown
(:meth:`ControlGroup.close`). The data path (the tables' all-to-alls, DDP's all-reduce, the
pipeline's prefetch) keeps its device groups; the health monitor talks to the rendezvous store,
no process group. docs/operations.md ("Collectives: groups and their order") lists which group
carries what, in which order.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_shardrec.distributed.comm.groups import live_group

#: the device every control flag is built on: the host, whatever the accelerator
CONTROL_DEVICE = torch.device("cpu")


class ControlGroup:
    """The gloo group (every rank, CPU tensors) that carries the control flags; see the module docstring."""

    def __init__(self, timeout: timedelta | None) -> None:
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None

    def group(self) -> dist.ProcessGroup:
        """The group; collective the first time (every rank creates it at the same point), then shared."""
        if not live_group(self._group):
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        assert self._group is not None
        return self._group

    @property
    def made(self) -> bool:
        """Whether the group exists (made and not destroyed)."""
        return live_group(self._group)

    def flag(self, value: int) -> torch.Tensor:
        """A one-element int64 flag on the host, ready to send on :meth:`group`."""
        return torch.tensor([int(value)], dtype=torch.int64, device=CONTROL_DEVICE)

    def close(self) -> None:
        """Destroy the group (teardown, also after a failure: a gloo group left to interpreter exit can abort
        it); a later fit makes another."""
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            from lightning_shardrec.lightning.failures.teardown import destroy_groups

            destroy_groups([group])
