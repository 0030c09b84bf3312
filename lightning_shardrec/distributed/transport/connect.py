"""Setting up the same-host transport: ``comm_transport=None (pg) | "pg" | "auto" | "shm"``.

:func:`attach` gives a :class:`~lightning_shardrec.distributed.comm.collectives.ShardingEnv` a
:class:`~lightning_shardrec.distributed.transport.shm.ShmTransport` when its mode allows and
:func:`connect` (collective) finds that every rank of the gloo group can share memory with every
other: each rank creates its region and the FIFOs it reads under ``/dev/shm``, opens the
others' and reads back their tokens (so ranks on different hosts or in containers without a
shared ``/dev/shm`` never match), and unlinks its files once every rank has opened them.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import secrets
from dataclasses import replace

import torch
import torch.distributed as dist

from lightning_shardrec.distributed.comm.collectives import ShardingEnv

# the modes and their parsing belong to the core's transport protocol (which resolves this module by name)
from lightning_shardrec.distributed.comm.transport import (  # noqa: F401  (TRANSPORTS: still importable here)
    DEFAULT_TRANSPORT,
    TRANSPORT_ENV,
    TRANSPORTS,
    parse_transport,
)
from lightning_shardrec.distributed.transport import records, shm
from lightning_shardrec.distributed.transport.shm import RESERVED_BYTES, SLOT_BYTES, SLOTS, ShmTransport

#: the several-hosts form, which builds on :func:`connect`: resolved by name when ``"auto"`` finds no shared
#: memory across all ranks (it imports this module, so this module does not import it)
PER_HOST = "lightning_shardrec.distributed.transport.per_host"


def attach(env: ShardingEnv, mode: str | None = None, timeout: float | None = None) -> ShardingEnv:
    """Collective over ``env.pg``: ``env`` with a same-host :class:`ShmTransport` for its all-to-alls.

    ``mode``: None (the default: ``$LIGHTNING_SHARDREC_TRANSPORT``, else ``"pg"``), ``"pg"`` (the
    process group's own: what runs under NCCL and across hosts), ``"auto"`` (shared memory when every
    rank of a gloo group can use it; on several hosts shared memory inside each and the group between
    them (:mod:`.per_host`); else the group; ``$LIGHTNING_SHARDREC_TRANSPORT`` may say ``shm`` or ``pg``
    instead) or ``"shm"`` (required: raises where it cannot be used). Ranks that disagree raise.
    ``timeout``: seconds a rank waits for a peer's data (None: the group's own collective timeout).
    """
    mode = parse_transport(mode)
    if mode is None:
        mode = parse_transport(os.environ.get(TRANSPORT_ENV, DEFAULT_TRANSPORT), TRANSPORT_ENV)
    if mode == "auto":
        mode = parse_transport(os.environ.get(TRANSPORT_ENV, "auto"), TRANSPORT_ENV)
    if env.world_size == 1 or env.transport is not None:
        return env
    backend = dist.get_backend(env.pg)  # the same on every rank: no collective needed to decide
    if backend != "gloo":
        transport, why = None, f"the process group's backend is {backend!r}, not 'gloo'"
    else:
        modes: list[str | None] = [None] * env.world_size
        dist.all_gather_object(modes, mode, group=env.pg)  # a rank that skipped connect() would hang the rest
        if len(set(modes)) > 1:
            raise ValueError(
                f"comm_transport differs between ranks ({', '.join(f'rank {r}: {m!r}' for r, m in enumerate(modes))}); "
                f"give every rank the same comm_transport and {TRANSPORT_ENV}"
            )
        if mode == "pg":
            return env
        transport, why = connect(env.pg, timeout)
        if transport is None and mode == "auto":  # several hosts: shared memory inside each
            connect_hosts = importlib.import_module(PER_HOST).connect_hosts
            host_transport, _ = connect_hosts(env.pg, timeout)
            if host_transport is not None:
                return replace(env, transport=host_transport)
    if transport is None:
        if mode == "shm":
            raise RuntimeError(
                f"comm_transport='shm': the ranks cannot share memory ({why}); use comm_transport='auto' to fall "
                "back to the process group"
            )
        return env
    return replace(env, transport=transport)


def connect(
    pg: dist.ProcessGroup | None = None, timeout: float | None = None, slot_bytes: int = SLOT_BYTES
) -> tuple[ShmTransport | None, str]:
    """Collective over ``pg``: ``(transport, "")`` when every rank can share memory with every
    other, else ``(None, why)`` on every rank (the reason of the first rank that could not).

    Only gloo groups (CPU tensors): a NCCL group keeps its own transport. The files live under
    ``/dev/shm`` until every rank has opened them, then are unlinked (nothing is left behind, also when
    a peer dies during setup). The first ``min(slot_bytes, RESERVED_BYTES)`` bytes of every slot are
    reserved here: a ``/dev/shm`` without room for them makes every rank keep the process group.
    """
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if world == 1:
        return None, "one rank"
    if dist.get_backend(pg) != "gloo":
        return None, f"the process group's backend is {dist.get_backend(pg)!r}, not 'gloo'"
    if slot_bytes <= 0 or slot_bytes % mmap.PAGESIZE:
        raise ValueError(f"ShmTransport: slot_bytes must be a positive multiple of {mmap.PAGESIZE}, got {slot_bytes}")
    token = secrets.token_hex(8)
    why = _unusable()
    infos = _gather((why, token), pg, world)
    failed = [f"rank {r}: {w}" for r, (w, _) in enumerate(infos) if w]
    if failed:
        return None, failed[0]
    base = os.path.join(shm.SHM_DIR, f"shardrec-{infos[0][1]}-")
    part, reserved = SLOTS * slot_bytes, min(slot_bytes, RESERVED_BYTES)
    made: list[str] = []
    fds: list[int] = []  # every descriptor opened here (closed unless a transport takes them)
    own_map, inbound, outbound, peers = None, {}, {}, {}
    held = 0  # bytes reserved here (given back unless a transport takes them)
    transport = None
    try:
        why = ""
        try:  # phase 1: this rank's region (a sparse file), the first pages of every slot, the FIFOs it reads
            path = f"{base}r{rank}"
            own_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fds.append(own_fd)
            made.append(path)
            os.ftruncate(own_fd, shm.PROBE + world * part)
            os.pwrite(own_fd, f"{token}:{rank}".encode(), 0)
            for d in range(world):
                for k in range(SLOTS if d != rank and reserved else 0):
                    records.reserve(own_fd, shm.PROBE + d * part + k * slot_bytes, reserved)
                    held += reserved
            own_map = mmap.mmap(own_fd, shm.PROBE + world * part, mmap.MAP_SHARED)  # may fail (address-space limit)
            for s in range(world):
                if s != rank:
                    fifo = f"{base}f{s}to{rank}"
                    os.mkfifo(fifo, 0o600)
                    made.append(fifo)
                    inbound[s] = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
                    fds.append(inbound[s])
        except (OSError, ValueError) as e:  # ValueError: mmap refused the size
            why = f"cannot create files or reserve {SLOTS * (world - 1)} x {reserved} bytes in {shm.SHM_DIR}: {e}"
        infos = _gather((why, token), pg, world)
        if not any(w for w, _ in infos):
            try:  # phase 2: every peer's region (its part for this rank) and the FIFOs to the peers
                for s, (_, peer_token) in enumerate(infos):
                    if s == rank:
                        continue
                    fd = os.open(f"{base}r{s}", os.O_RDWR)
                    try:
                        if os.pread(fd, 64, 0).rstrip(b"\0") != f"{peer_token}:{s}".encode():
                            raise OSError(f"rank {s}'s region holds other bytes (not the same shared memory)")
                        peers[s] = mmap.mmap(fd, part, mmap.MAP_SHARED, offset=shm.PROBE + rank * part)
                    finally:
                        os.close(fd)
                    outbound[s] = os.open(f"{base}f{rank}to{s}", os.O_WRONLY | os.O_NONBLOCK)
                    fds.append(outbound[s])
                    os.set_blocking(outbound[s], True)
            except (OSError, ValueError) as e:
                why = f"cannot open the other ranks' files in {shm.SHM_DIR}: {e}"
        infos = _gather((why, token), pg, world)  # every rank has opened everything (or failed)
        failed = [f"rank {r}: {w}" for r, (w, _) in enumerate(infos) if w]
        if failed:
            return None, failed[0]
        wait = group_timeout(pg) if timeout is None else timeout
        assert own_map is not None  # every rank succeeded, this one included
        fifos = (inbound, outbound)
        transport = ShmTransport(pg, rank, world, (own_fd, own_map), peers, fifos, slot_bytes, wait, reserved)
        return transport, ""
    finally:  # also when a peer died mid-setup (a gather raised): nothing is left in /dev/shm
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if transport is None:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            records.release(held)


def group_timeout(pg: dist.ProcessGroup | None) -> float:
    """Seconds of ``pg``'s collective timeout (600 where the backend does not say)."""
    group = pg if pg is not None else dist.group.WORLD
    try:
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return 600.0


def _unusable() -> str:
    """Why this rank cannot use the transport ('' if it can)."""
    if not hasattr(os, "mkfifo") or not hasattr(os, "posix_fallocate"):
        return "no FIFOs or posix_fallocate on this OS"
    if not os.path.isdir(shm.SHM_DIR) or not os.access(shm.SHM_DIR, os.W_OK):
        return f"no writable {shm.SHM_DIR}"
    return ""


def _gather(info: tuple[str, str], pg: dist.ProcessGroup | None, world: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str] | None] = [None] * world
    dist.all_gather_object(out, info, group=pg)
    return [o for o in out if o is not None]
