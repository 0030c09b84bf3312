"""Sharding types, each mapped to the mechanism that runs it (a registry, not if/elif).

Row-wise tables reduce their pooled partials over all ranks (:class:`RowBlockSharding`);
table-row-wise and grid tables, whose blocks share a host, reduce inside the host and
send each source its share across hosts (:class:`HostRowBlockSharding`). Dynamic tables
run the table-wise or row-wise mechanism with their id mapping added
(:class:`DynamicTableSharding`, :class:`DynamicRowSharding`, both a :class:`DynamicMapping`).

One file per sharding type. May import comm/, kernels, modules, optim, planner, sparse; never sharded/, dmp/,
health/ or pipelines/ (a new type: a file here, a row in the registry below, and the planner's cost for it).
"""

from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.distributed.sharding.base import EmbeddingSharding, KernelSetup, TableSharding
from lightning_shardrec.distributed.sharding.data_parallel import DataParallelSharding
from lightning_shardrec.distributed.sharding.dynamic_blocks import (
    DYNAMIC_SHARDINGS,
    DynamicMapping,
    DynamicRowSharding,
    DynamicTableSharding,
    unfit_type,
)
from lightning_shardrec.distributed.sharding.host_blocks import HostRowBlockSharding
from lightning_shardrec.distributed.sharding.piecewise import PiecewiseSharding
from lightning_shardrec.distributed.sharding.row_blocks import RowBlockSharding
from lightning_shardrec.planner import ParameterSharding, ShardingType

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

#: Every mechanism, in the fixed order a collection's groups follow (identical on every rank).
KINDS: list[type[EmbeddingSharding]] = [*dict.fromkeys(SHARDINGS.values()), *DYNAMIC_SHARDINGS.values()]


def mechanism(config: BaseEmbeddingConfig, plan: ParameterSharding) -> type[EmbeddingSharding]:
    """The mechanism that runs ``config``'s table under ``plan`` (dynamic tables: their own)."""
    if config.dynamic is None:
        return SHARDINGS[plan.sharding_type]
    if plan.sharding_type not in DYNAMIC_SHARDINGS:
        raise unfit_type(config, plan)
    return DYNAMIC_SHARDINGS[plan.sharding_type]


__all__ = [
    "KINDS",
    "SHARDINGS",
    "DataParallelSharding",
    "DYNAMIC_SHARDINGS",
    "DynamicMapping",
    "DynamicRowSharding",
    "DynamicTableSharding",
    "EmbeddingSharding",
    "HostRowBlockSharding",
    "KernelSetup",
    "PiecewiseSharding",
    "RowBlockSharding",
    "TableSharding",
    "mechanism",
]
