"""Sharding types at TorchRec's path (``torchrec.distributed.types``)."""

from __future__ import annotations

from lightning_shardrec._compat.torch import sharded_tensor_type
from lightning_shardrec.compat.torchrec.distributed.awaitables import (
    Awaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder
from lightning_shardrec.errors import missing_names
from lightning_shardrec.planner import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from lightning_shardrec.planner.plans.table_params import CacheParams, KeyValueParams

_missing = missing_names(
    __name__,
    {
        "ShardedModule": "the sharded collections are ShardedEmbeddingBagCollection / ShardedEmbeddingCollection",
        "ShardingPlanner": "use EmbeddingShardingPlanner",
        "EnumerableShardingSpec": "shards are described by ShardMetadata",
        "QuantizedCommCodecs": "use get_qcomm_codecs_registry from lightning_shardrec.distributed.fbgemm_qcomm_codec",
        "ShardingEnv2D": "2D parallelism is not supported",
        "PipelineType": "the pipeline is TrainPipelineSparseDist or ShardRecStrategy(pipeline=True)",
    },
)


def __getattr__(name: str) -> object:
    """``ShardedTensor`` is torch's (what ``DistributedModelParallel.state_dict()`` holds for a sharded table),
    imported on first use as TorchRec's module does; TorchRec's names not provided are refused by name."""
    if name == "ShardedTensor":
        return sharded_tensor_type()
    return _missing(name)


__all__ = [
    "Awaitable",
    "GetItemLazyAwaitable",
    "CacheParams",
    "KeyValueParams",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "NoWait",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "ModuleSharder",
    "ModuleShardingPlan",
    "ParameterSharding",
    "ShardMetadata",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
]
