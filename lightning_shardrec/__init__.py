"""lightning_shardrec: TorchRec-style embedding sharding as a PyTorch Lightning strategy."""

from lightning_shardrec.configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbOptimType,
    FusedOptimConfig,
    PoolingType,
)
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from lightning_shardrec.data import RecBatch
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    Topology,
)

from lightning_shardrec.distributed import DistributedModelParallel
from lightning_shardrec.lightning import ShardRecStrategy  # registers strategy="shardrec"

__version__ = "0.1.0"

_LAZY_DATA = ("CriteoDataModule", "SyntheticRecDataModule")  # import Lightning on first use


def __getattr__(name: str) -> object:
    if name in _LAZY_DATA:
        from lightning_shardrec.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module 'lightning_shardrec' has no attribute {name!r}")


__all__ = [
    "DistributedModelParallel",
    "ShardRecStrategy",
    "CriteoDataModule",
    "RecBatch",
    "SyntheticRecDataModule",
    "DataType",
    "EmbOptimType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FusedOptimConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "__version__",
    "ShardingType",
    "ParameterConstraints",
    "ShardingPlan",
    "ParameterSharding",
    "EmbeddingShardingPlanner",
    "Topology",
]
