"""A clean exit: the process groups the strategy creates are destroyed, not left to interpreter exit.

A gloo process group still alive when Python exits is torn down during interpreter
finalization, in no particular order, while its worker threads may still hold work or
need the GIL; now and then that ends the process with ``terminate called without an
active exception`` (SIGABRT, exit -6) after a run that finished, which a scheduler
marks as failed. So:

* the groups the strategy makes for itself (the dense layers' DDP group, the pipeline's
  prefetch group, the lagged SIGTERM group) are destroyed in ``teardown``
  (:func:`destroy_groups`), which every rank reaches after ``fit``/``validate``/...;
* the shared-memory transports (:mod:`lightning_shardrec.distributed.transport`) are closed: the
  dense all-reduce's with its DDP wrapper, the pipeline's with the pipeline; the sharded
  collections keep theirs for a later fit, validate or predict (closed when they are freed);
* the default group, when the strategy's ``setup_distributed`` created it, is destroyed
  by an ``atexit`` hook (:func:`destroy_default_group_at_exit`), after the user's script
  is done with it (``trainer.save_checkpoint`` after ``fit`` still needs it), while the
  interpreter is whole.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Iterable

import torch.distributed as dist

log = logging.getLogger(__name__)
_AT_EXIT = False


def destroy_groups(groups: Iterable[dist.ProcessGroup]) -> None:
    """Destroy ``groups`` (not the default one); already destroyed ones are skipped."""
    if not dist.is_initialized():
        return
    for group in groups:
        with contextlib.suppress(ValueError, RuntimeError):  # ValueError: gone already (destroyed)
            dist.destroy_process_group(group)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: never turn a clean exit into a traceback
            dist.destroy_process_group()


def destroy_default_group_at_exit() -> None:
    """Destroy every process group (the default one included) when the interpreter exits; once."""
    global _AT_EXIT
    if not _AT_EXIT:
        atexit.register(_destroy_default_group)
        _AT_EXIT = True
