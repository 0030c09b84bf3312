"""A clean exit: every thread the library started is joined, every group it made destroyed and freed.

A process that finished its work can still die at exit with ``terminate called without an
active exception`` (SIGABRT, exit -6), which a scheduler marks as failed. Two ways lead there,
both at interpreter finalization (Python 3.11: a thread that wants the GIL then is ended with
``pthread_exit``, and unwinding a C++ frame that may not throw calls ``std::terminate``):

* a daemon Python thread inside a torch call that released the GIL (a heartbeat's store
  ``add``, a store read) when finalization starts;
* a process group's native worker threads that touch Python objects (a tensor's, a hook's)
  while or after the interpreter is torn down: a group that was never destroyed is freed
  from torch's C++ registry after finalization, and ``destroy_process_group(group)`` alone
  does not stop its threads while Python still holds the group object.

So, in order:

* ``teardown`` (every rank, after ``fit``/``validate``/...) stops the health monitor (its
  threads joined), the SIGTERM watcher and the lagged SIGTERM broadcast, closes the
  shared-memory transports of the dense all-reduce and the pipeline, and destroys the groups
  the strategy made for itself (the dense layers' DDP group, the pipeline's prefetch group,
  the control group of the SIGTERM flag and the uneven-batches agreement: :func:`destroy_groups`), dropping its
  references to them; the sharded collections keep theirs for a later fit, validate or predict;
* at interpreter exit, while the interpreter is whole (:func:`shutdown_at_exit`, registered when
  this module is imported, so for any program that imports the library, Lightning or not):
  what a strategy never torn down holds is released as its ``teardown`` would (:func:`release_at_exit`:
  a Fabric script need not call ``fabric.strategy.teardown()``), every health monitor still running
  is stopped, the library's other threads are joined (a bounded wait), the groups the library cached
  (:func:`lightning_shardrec.distributed.comm.groups.cached_group`) are destroyed, every group is
  destroyed when the strategy created the default group (a ``trainer.save_checkpoint`` after ``fit``
  still needs it until then), and the library's references to groups are dropped and collected, so
  each group's threads stop now.

A thread stuck in a store call whose server never answers (a frozen host) cannot be joined;
its name is logged at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch.distributed as dist

from lightning_shardrec.distributed.comm import groups as _groups
from lightning_shardrec.distributed.health import heartbeats as health

log = logging.getLogger(__name__)
#: the library's thread names start with this (heartbeat, store timer, explain, SIGTERM watcher)
THREAD_PREFIX = "shardrec-"
#: seconds the exit hook waits, in all, for the library's threads
EXIT_JOIN_S = 30.0
_STATE = {"default_group_is_ours": False}


class Releasable(Protocol):
    """A strategy whose ``release()`` stops its threads and destroys its groups (idempotent, never collective)."""

    def release(self) -> None: ...


#: strategies to release at exit (held weakly: one collected has nothing left to release)
_TO_RELEASE: weakref.WeakSet[Releasable] = weakref.WeakSet()


def release_at_exit(strategy: Releasable) -> None:
    """Call ``strategy.release()`` at interpreter exit, before the groups are destroyed (a script may never
    tear it down: Fabric calls no ``teardown``)."""
    _TO_RELEASE.add(strategy)


def _release_all() -> None:
    for strategy in list(_TO_RELEASE):
        try:
            strategy.release()
        except Exception:  # the others, and the rest of the shutdown, still run
            log.debug("lightning_shardrec: release at exit of %s", type(strategy).__name__, exc_info=True)
    _TO_RELEASE.clear()


def destroy_groups(groups: Iterable[dist.ProcessGroup]) -> None:
    """Destroy ``groups`` (not the default one); already destroyed ones are skipped."""
    if not dist.is_initialized():
        return
    for group in groups:
        with contextlib.suppress(ValueError, RuntimeError):  # ValueError: gone already (destroyed)
            dist.destroy_process_group(group)


def library_threads() -> list[threading.Thread]:
    """The library's threads still running in this process."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def join_threads(timeout: float) -> list[str]:
    """Join the library's threads, ``timeout`` seconds in all; the names of those still running."""
    end = time.monotonic() + timeout
    for thread in library_threads():
        if thread is not threading.current_thread():
            thread.join(timeout=max(0.0, end - time.monotonic()))
    return [t.name for t in library_threads()]


def shutdown_at_exit() -> None:
    """Stop, join, destroy and free what the library started (see the module docstring); never raises."""
    try:
        _release_all()
        stuck = health.stop_all(timeout=EXIT_JOIN_S)
        stuck = sorted(set(stuck) | set(join_threads(EXIT_JOIN_S)))
        if stuck:
            log.warning("lightning_shardrec: threads still running at exit (a store that never answers?): %s", stuck)
        if dist.is_initialized():
            if _STATE["default_group_is_ours"]:
                dist.destroy_process_group()  # every group, the default one included
            else:
                destroy_groups(_groups.cached_groups())
        _groups.forget_cached_groups()  # the last references: the groups' threads stop now
        gc.collect()
    except Exception:  # exiting anyway: never turn a clean exit into a traceback
        log.debug("lightning_shardrec: shutdown at exit", exc_info=True)


def destroy_default_group_at_exit() -> None:
    """The strategy created the default group: destroy every group (the default one included) at exit."""
    _STATE["default_group_is_ours"] = True


atexit.register(shutdown_at_exit)
