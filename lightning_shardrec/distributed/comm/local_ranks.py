"""TorchRec's launcher helpers (``torchrec.distributed.comm``): ranks per host, this rank's place on its host.

TorchRec programs size their ``Topology`` with them (``Topology(world_size=..., local_world_size=get_local_size())``).
They read what the launcher exported (torchrun, Lightning and SLURM-via-torchrun set ``LOCAL_WORLD_SIZE`` and
``LOCAL_RANK``; MPI launchers their own names) and fall back as TorchRec 1.8 does, warnings included: without a
usable local size, a whole world that 8 divides is taken as hosts of 8, any other as one host.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

logger: logging.Logger = logging.getLogger(__name__)

_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")


def _env_int(names: tuple[str, ...], default: int) -> int:
    """The first of ``names`` set to an integer >= 0, else ``default``."""
    for name in names:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
        if value >= 0:
            return value
    return default


def _world(world_size: int | None) -> int:
    if world_size is not None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return world_size
    if not dist.is_initialized():
        raise RuntimeError("pass world_size, or initialize the default process group first")
    return dist.get_world_size()


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    if not dist.is_initialized():
        raise RuntimeError("pass rank, or initialize the default process group first")
    return dist.get_rank()


def get_local_size(world_size: int | None = None) -> int:
    """Ranks per host (``nproc_per_node``): the launcher's local world size when it divides the world."""
    world = _world(world_size)
    local = _env_int(_LOCAL_SIZE_VARS, 8)
    if local == 0 or world % local != 0:
        logger.warning("Could not determine LOCAL_WORLD_SIZE from environment, falling back to WORLD_SIZE.")
        local = world
    return local


def get_node_group_size(world_size: int | None = None) -> int:
    """Ranks per node group: :func:`get_local_size` (no 2D parallelism here)."""
    return get_local_size(world_size)


def get_local_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This rank's place on its host: the launcher's local rank, else ``rank % get_local_size()``."""
    local_rank = _env_int(_LOCAL_RANK_VARS, -1)
    local = get_local_size(world_size)
    if local_rank == -1 or local_rank >= local:
        logger.warning("Could not determine LOCAL_RANK from environment, falling back to GLOBAL_RANK % LOCAL_SIZE.")
        local_rank = _rank(rank) % local
    return local_rank


def get_group_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """The host (worker group) this rank is on: ``rank // get_local_size()``."""
    return _rank(rank) // get_local_size(world_size)


def get_num_groups(world_size: int | None = None) -> int:
    """Hosts (worker groups): ``world_size // get_local_size()``."""
    world = _world(world_size)
    return world // get_local_size(world)


__all__ = ["get_group_rank", "get_local_rank", "get_local_size", "get_node_group_size", "get_num_groups"]
