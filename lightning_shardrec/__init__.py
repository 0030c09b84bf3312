"""lightning_shardrec: TorchRec-style embedding sharding as a PyTorch Lightning strategy.

Importing the package registers ``Trainer(strategy="shardrec")``.
"""

from lightning_shardrec.configs import (
    DataType,
    DynamicConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbOptimType,
    FusedOptimConfig,
    PoolingType,
)
from lightning_shardrec.data import RecBatch
from lightning_shardrec.distributed import DistributedModelParallel
from lightning_shardrec.lightning import ShardRecStrategy  # registers strategy="shardrec"
from lightning_shardrec.metrics import Calibration, NormalizedEntropy
from lightning_shardrec.models import DLRM, DCNv2, DLRMTask
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    Topology,
)
from lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__version__ = "0.1.0"

_LAZY_DATA = ("CriteoDataModule", "SyntheticRecDataModule")


def __getattr__(name: str) -> object:
    if name in _LAZY_DATA:
        from lightning_shardrec.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module 'lightning_shardrec' has no attribute {name!r}")


__all__ = [
    "DLRM",
    "Calibration",
    "CriteoDataModule",
    "DCNv2",
    "DLRMTask",
    "DataType",
    "DynamicConfig",
    "DistributedModelParallel",
    "EmbOptimType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingShardingPlanner",
    "FusedOptimConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "NormalizedEntropy",
    "ParameterConstraints",
    "ParameterSharding",
    "PoolingType",
    "RecBatch",
    "ShardRecStrategy",
    "ShardingPlan",
    "ShardingType",
    "SyntheticRecDataModule",
    "Topology",
    "__version__",
]

from lightning_shardrec import torchrec_paths as _torchrec_paths  # noqa: E402

_torchrec_paths.install()  # TorchRec paths we lack raise a named error, not ModuleNotFoundError
