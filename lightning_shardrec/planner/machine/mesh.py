"""The host layout as a torch ``DeviceMesh``: ``(hosts, local)``, dims named ``("host", "local")``.

Ranks ``h*L .. h*L+L-1`` form host ``h`` (Lightning's numbering under every launcher it supports,
and torchrun's). :func:`host_mesh` builds the mesh with torch's public
``init_device_mesh(device_type, (hosts, local), mesh_dim_names=("host", "local"))``; the planner's
:class:`~lightning_shardrec.planner.Topology` (``Topology.from_device_mesh``), the sharded modules'
``ShardingEnv`` and the host groups of row-blocked shardings (``mesh.get_group("local")``) all take
the layout from it. This module is the one place the ranks per host are read from a launcher
(:func:`launcher_local_world_size`), and only when the caller (Lightning's strategy, which knows
its cluster environment's ``num_nodes x devices``) does not say.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("host", "local")
#: per world group, the mesh built over it (a new world, after ``destroy_process_group``, builds anew)
_MESHES: dict[tuple[int, str, int], tuple[Any, DeviceMesh]] = {}


def launcher_local_world_size(world: int, environ: Mapping[str, str] | None = None) -> int:
    """Ranks per host from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun, Lightning's own launcher),
    ``SLURM_NTASKS_PER_NODE``, or the world over ``NUM_NODES`` / ``SLURM_NNODES`` / ``NNODES``; else one host.

    Values not dividing ``world`` are skipped.
    """
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        if value.isdigit() and int(value) > 0 and world % int(value) == 0:
            return int(value)
    for key in ("NUM_NODES", "SLURM_NNODES", "NNODES"):
        value = env.get(key, "")
        if value.isdigit() and int(value) > 0 and world % int(value) == 0:
            return world // int(value)
    return world


def host_mesh(local_world_size: int = 0, device_type: str | None = None) -> DeviceMesh:
    """Collective (every rank of the default group, once per world): the ``(hosts, local)`` mesh.

    ``local_world_size`` (ranks per host; 0: :func:`launcher_local_world_size`) must divide the world
    size. ``device_type`` defaults to ``cuda`` under NCCL, else ``cpu``. The mesh is built once per
    world group and layout and reused.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "host_mesh: torch.distributed is not initialized; call init_process_group first "
            "(or train with Trainer(strategy='shardrec'))"
        )
    world = dist.get_world_size()
    local = local_world_size or launcher_local_world_size(world)
    if not isinstance(local, int) or local <= 0 or world % local:
        raise ValueError(
            f"host_mesh: local_world_size (ranks per host) must be a positive int dividing the world size "
            f"{world}, got {local_world_size!r}"
        )
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    key = (world, device_type, local)
    found = _MESHES.get(key)
    if found is not None and found[0] is dist.group.WORLD:
        return found[1]
    mesh = init_device_mesh(device_type, (world // local, local), mesh_dim_names=MESH_DIMS)
    _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


def built_mesh(world: int, local: int = 0) -> DeviceMesh | None:
    """The mesh :func:`host_mesh` last built over the live world of ``world`` ranks (with ``local``
    ranks per host; 0: any), if it did; not collective."""
    found = None
    for (w, _, lws), (group, mesh) in _MESHES.items():
        if w == world and local in (0, lws) and group is dist.group.WORLD:
            found = mesh
    return found


def mesh_layout(mesh: Any) -> tuple[int, int]:
    """``(hosts, ranks per host)`` of a 2-D mesh whose dims are ``("host", "local")``."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names != MESH_DIMS:
        raise ValueError(
            f"mesh_layout: expected a 2-D DeviceMesh with mesh_dim_names {MESH_DIMS}, got {names or None} "
            f"(build it with init_device_mesh(device, (hosts, local), mesh_dim_names={MESH_DIMS}))"
        )
    return int(mesh.size(0)), int(mesh.size(1))
