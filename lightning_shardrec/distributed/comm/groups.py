"""Process groups beyond the default one: liveness, reuse, and a copy of a sharding's group.

A gloo or NCCL group holds transport threads and sockets until it is destroyed, so groups a
module needs again and again (DMP's dense group, the host groups of hierarchical shardings)
are made once per set of ranks and shared (:func:`cached_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from datetime import timedelta

import torch.distributed as dist

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.same_host import attach_transport


def live_group(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is a process group still registered (not None, not destroyed)."""
    if group is None:
        return False
    try:
        dist.get_backend(group)  # raises for a destroyed group
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


_GROUPS: dict[tuple[Hashable, ...], dist.ProcessGroup] = {}


def cached_group(key: tuple[Hashable, ...], make: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup:
    """The group ``make()`` created for ``key``, reused while it lives (until destroyed).

    Collective only when it calls ``make`` (every rank keeps the same cache, so all of them
    create, or reuse, together). Each group holds transport threads and sockets until it is
    destroyed, so modules built again and again (a DMP per trial, per test) share one.
    """
    group = _GROUPS.get(key)
    if group is None or not live_group(group):
        group = _GROUPS[key] = make()
    return group


def cached_groups() -> list[dist.ProcessGroup]:
    """The groups :func:`cached_group` made that are still registered."""
    return [g for g in _GROUPS.values() if live_group(g)]


def forget_cached_groups() -> None:
    """Drop the cache's references (at exit, after destroying them: a group's threads stop when it is freed)."""
    _GROUPS.clear()


def new_group_like(env: ShardingEnv, timeout: timedelta | None = None) -> ShardingEnv:
    """Collective: a new process group over ``env``'s ranks (same backend), e.g. for prefetched input dist;
    with its own shared-memory transport when ``env`` has one."""
    ranks = dist.get_process_group_ranks(env.pg or dist.group.WORLD)
    group = dist.new_group(ranks=ranks, backend=dist.get_backend(env.pg), timeout=timeout)
    new = ShardingEnv.from_process_group(group, env.local_world_size)
    if env.transport is None:
        return new
    return attach_transport(new, env.transport.mode)
