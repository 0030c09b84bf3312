"""Sharding types, each mapped to the mechanism that runs it (a registry, not if/elif).

Row-wise tables reduce their pooled partials over all ranks (:class:`RowBlockSharding`);
table-row-wise and grid tables, whose blocks share a host, reduce inside the host and
send each source its share across hosts (:class:`HostRowBlockSharding`).
"""

from lightning_shardrec.distributed.sharding.base import EmbeddingSharding, KernelSetup, TableSharding
from lightning_shardrec.distributed.sharding.data_parallel import DataParallelSharding
from lightning_shardrec.distributed.sharding.host_blocks import HostRowBlockSharding
from lightning_shardrec.distributed.sharding.piecewise import PiecewiseSharding
from lightning_shardrec.distributed.sharding.row_blocks import RowBlockSharding
from lightning_shardrec.planner import ShardingType

#: Mechanism per sharding type. Types that share a mechanism are looked up together,
#: in one group, with one set of collectives per batch.
SHARDINGS: dict[ShardingType, type[EmbeddingSharding]] = {
    ShardingType.TABLE_WISE: PiecewiseSharding,
    ShardingType.COLUMN_WISE: PiecewiseSharding,
    ShardingType.ROW_WISE: RowBlockSharding,
    ShardingType.TABLE_ROW_WISE: HostRowBlockSharding,
    ShardingType.GRID_SHARD: HostRowBlockSharding,
    ShardingType.DATA_PARALLEL: DataParallelSharding,
}

__all__ = [
    "SHARDINGS",
    "DataParallelSharding",
    "EmbeddingSharding",
    "HostRowBlockSharding",
    "KernelSetup",
    "PiecewiseSharding",
    "RowBlockSharding",
    "TableSharding",
]
