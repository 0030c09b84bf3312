"""Collectives: ``ShardingEnv``, the all-to-alls and reduce-scatters with their gradients, the wire precision
(``qcomm``), process groups, and the routing of a KJT to the ranks that own its tables (``input_dist``).
May import sparse, errors, configs, planner, modules; never sharding/, sharded/, dmp/, health/ or pipelines/.
"""

from lightning_shardrec.distributed.comm.collectives import ShardingEnv

__all__ = ["ShardingEnv"]
