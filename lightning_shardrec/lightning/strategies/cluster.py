"""Ranks per host as Lightning laid them out (not from launcher-specific environment variables).

Lightning numbers ranks ``global_rank = node_rank * num_processes + local_rank``
(``DDPStrategy.set_world_ranks``) under every launcher and cluster environment it
supports (its own subprocess launcher, torchrun, SLURM, LSF, MPI, Kubeflow), so the
ranks of node ``h`` are ``h*L .. h*L+L-1`` with ``L = num_processes`` (devices per node):
exactly the host layout :class:`~lightning_shardrec.planner.Topology` and
:class:`~lightning_shardrec.distributed.comm.collectives.ShardingEnv` assume. Environment variables
(``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``, ...) are only the fallback when the
strategy's numbers do not describe the process group (a group created outside Lightning).
"""

from __future__ import annotations

from lightning_shardrec.planner.machine.topology import local_world_size_from_env


def ranks_per_host(world_size: int, num_nodes: int, num_processes: int) -> int:
    """``num_processes`` when ``num_nodes * num_processes == world_size``, else the environment's answer.

    ``world_size`` is the live process group's size; ``num_nodes`` and ``num_processes``
    are the strategy's (``Trainer(num_nodes=..., devices=...)``)::

        ranks_per_host(4, 2, 2) == 2     # 2 nodes x 2 devices: hosts {0, 1} and {2, 3}
    """
    if num_nodes > 0 and num_processes > 0 and num_nodes * num_processes == world_size:
        return num_processes
    return local_world_size_from_env(world_size)
