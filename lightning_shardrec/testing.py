"""Run a function on W ranks (gloo on CPU) and get every rank's result back.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on each
rank of a process group and returns the results in rank order; a failure on any rank
raises in the caller with that rank's traceback. Workers are started once per world
size and reused across calls (starting a torch process costs seconds), and are
replaced after a failure so a broken collective never leaks into the next call.
``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

_POOLS: dict[tuple[int, str], RankPool] = {}
KEEP_RANKS = 4  # pools of at most this many ranks stay up for the next call; larger ones close after theirs
CLOSE_S = 30.0  # seconds the workers of a pool get, in all, to exit cleanly (a loaded machine) before a kill


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, backend: str, port: int, jobs: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # report everything; the parent decides
            results.put((rank, False, traceback.format_exc()))
    from lightning_shardrec.lightning.failures.teardown import shutdown_at_exit

    shutdown_at_exit()  # monitors and threads a test left running, the library's cached groups
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world_size`` worker processes sharing one process group."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        env = {"OMP_NUM_THREADS": "1"}
        os.environ.update(env)
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, backend, port, self.jobs[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
        for q in self.jobs:
            q.put((fn, args))
        out: list[Any] = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{fn.__name__}: no answer from every rank within {timeout:.0f} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors))
            raise RuntimeError(f"{fn.__name__} failed on ranks {[r for r, _ in errors]}:\n{detail}")
        return out

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        end = time.monotonic() + CLOSE_S
        for p in self.procs:
            p.join(timeout=max(0.1, end - time.monotonic()))  # each rank stops its threads, destroys its groups
            if p.is_alive():
                p.kill()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 180.0
) -> list[Any]:
    """``[fn(rank, world_size, *args) for every rank]``, run in parallel in one process group.

    Groups of up to :data:`KEEP_RANKS` ranks are kept for the next call (tests share them); a larger
    one is closed after its call, so its idle workers hold no memory and no CPU meanwhile.
    """
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        pool = _POOLS[key] = RankPool(world_size, backend)
    failed = True
    try:
        out = pool.run(fn, *args, timeout=timeout)
        failed = False
        return out
    finally:
        if failed or world_size > KEEP_RANKS:
            pool.close()
            del _POOLS[key]


@contextmanager
def local_world_size(ranks_per_host: int | None) -> Iterator[None]:
    """Pretend ``ranks_per_host`` ranks per host inside the block (sets ``LOCAL_WORLD_SIZE``; None: leave it).

    In a rank of :func:`run_ranks`: ``ShardingEnv`` and ``Topology`` built inside then see
    hosts ``0..W/L-1`` on one machine, so multi-host collectives run on CPU.
    """
    old = os.environ.get("LOCAL_WORLD_SIZE")
    if ranks_per_host is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_host)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old


@atexit.register
def close_pools() -> None:
    """Stop every pool's workers (each exits cleanly: threads joined, groups destroyed); also at exit."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@contextmanager
def pretend_hosts(rank: int, layout: str) -> Iterator[None]:
    """Collective (every rank of the default group): this rank's ``/dev/shm`` as on host ``layout[rank]``.

    ``layout`` names each rank's host, e.g. ``"aabb"`` (2 hosts x 2 ranks): inside the block each
    host's ranks share a directory of their own as ``/dev/shm``, so they share memory only with
    each other, as on separate nodes (:mod:`lightning_shardrec.distributed.transport.per_host`).
    """
    import shutil
    import tempfile

    import torch.distributed as dist

    from lightning_shardrec.distributed.transport import shm

    names: list[str | None] = [None]
    if rank == 0:
        made = tempfile.mkdtemp(prefix="shardrec-hosts-", dir=shm.SHM_DIR if os.path.isdir(shm.SHM_DIR) else None)
        for host in set(layout):
            os.mkdir(os.path.join(made, host))
        names[0] = made
    dist.broadcast_object_list(names, src=0)
    old, shm.SHM_DIR = shm.SHM_DIR, os.path.join(str(names[0]), layout[rank])
    try:
        yield
    finally:
        shm.SHM_DIR = old
        dist.barrier()
        if rank == 0:
            shutil.rmtree(str(names[0]), ignore_errors=True)
