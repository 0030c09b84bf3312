"""Collectives: ``ShardingEnv``, the all-to-alls and reduce-scatters with their gradients, the wire precision
(``qcomm``), process groups, and the routing of a KJT to the ranks that own its tables (``input_dist``).
May import sparse, errors, configs, planner, modules; never sharding/, sharded/, dmp/, health/ or pipelines/.

Also TorchRec's ``torchrec.distributed.comm`` launcher helpers (``get_local_size``, ``get_local_rank``, ...).
"""

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.local_ranks import (
    get_group_rank,
    get_local_rank,
    get_local_size,
    get_node_group_size,
    get_num_groups,
)
from lightning_shardrec.errors import missing_names

__getattr__ = missing_names(
    __name__,
    {
        name: "the sharded collections make the groups they need (host groups for table_row_wise and grid_shard)"
        for name in ("intra_and_cross_node_pg", "intra_and_cross_node_pg_2D", "get_topology_group_world_size",
                     "get_topology_domain_multiple")
    },
)  # fmt: skip

__all__ = [
    "ShardingEnv",
    "get_group_rank",
    "get_local_rank",
    "get_local_size",
    "get_node_group_size",
    "get_num_groups",
]
