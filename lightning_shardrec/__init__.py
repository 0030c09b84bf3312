"""lightning_shardrec: TorchRec-style embedding sharding as a PyTorch Lightning strategy.

``import lightning_shardrec`` registers ``Trainer(strategy="shardrec")`` and does nothing else:
the public names below load their submodule on first access (PEP 562), and nothing of torch's
or Lightning's changes until a strategy is set up. Importing a Lightning-free submodule alone
(``import lightning_shardrec.sparse``, ``lightning_shardrec.inference``, ``.data``, ``.planner``...)
imports no Lightning; it registers the strategy where Lightning is imported already, or at the
first public name used (``from lightning_shardrec import ...``) once it is. To be explicit, pass
``strategy=ShardRecStrategy()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING

from lightning_shardrec.compat.torchrec import paths as _torchrec_paths

if TYPE_CHECKING:
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
    from lightning_shardrec.data.datamodule import CriteoDataModule, SyntheticRecDataModule
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.lightning import ShardRecStrategy
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

#: each public name -> the submodule it is loaded from on first access
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "DataType",
            "DynamicConfig",
            "EmbeddingBagConfig",
            "EmbeddingConfig",
            "EmbOptimType",
            "FusedOptimConfig",
            "PoolingType",
        ),
        "lightning_shardrec.configs",
    ),
    "RecBatch": "lightning_shardrec.data",
    "CriteoDataModule": "lightning_shardrec.data.datamodule",
    "SyntheticRecDataModule": "lightning_shardrec.data.datamodule",
    "DistributedModelParallel": "lightning_shardrec.distributed",
    "ShardRecStrategy": "lightning_shardrec.lightning",
    "Calibration": "lightning_shardrec.metrics",
    "NormalizedEntropy": "lightning_shardrec.metrics",
    "DLRM": "lightning_shardrec.models",
    "DCNv2": "lightning_shardrec.models",
    "DLRMTask": "lightning_shardrec.models",
    "EmbeddingBagCollection": "lightning_shardrec.modules",
    "EmbeddingCollection": "lightning_shardrec.modules",
    **dict.fromkeys(
        (
            "EmbeddingShardingPlanner",
            "ParameterConstraints",
            "ParameterSharding",
            "ShardingPlan",
            "ShardingType",
            "Topology",
        ),
        "lightning_shardrec.planner",
    ),
    "JaggedTensor": "lightning_shardrec.sparse",
    "KeyedJaggedTensor": "lightning_shardrec.sparse",
    "KeyedTensor": "lightning_shardrec.sparse",
}


_STRATEGY = "lightning_shardrec.lightning.strategies.strategy"  # importing it registers strategy="shardrec"


def _register_if_lightning_is_loaded() -> bool:
    """Register ``strategy="shardrec"`` where Lightning is imported (a cheap check); whether it is registered."""
    if _STRATEGY not in sys.modules and "lightning.pytorch" in sys.modules:
        importlib.import_module(_STRATEGY)
    return _STRATEGY in sys.modules


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        # `import torchrec; torchrec.distributed.X` works in TorchRec: a subpackage loads on first access too.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'lightning_shardrec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    # A Lightning-free submodule imported the package before Lightning was: register on the next use of a
    # public name once Lightning is loaded (`import lightning_shardrec.testing; import lightning;
    # from lightning_shardrec import EmbeddingBagCollection`). Cached once registered.
    if _register_if_lightning_is_loaded():
        globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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


#: the subpackages that never import Lightning (serving, data loading, planning, the layers below the strategy)
_LIGHTNING_FREE = frozenset(
    (
        "_compat",
        "_fbgemm",
        "checkpoint",
        "compat",
        "configs",
        "data",
        "datasets",
        "distributed",
        "errors",
        "inference",
        "kernels",
        "metrics",
        "modules",
        "optim",
        "plan",
        "planner",
        "sparse",
        "testing",
        "user_cache",
    )
)


def _imported_for_a_lightning_free_submodule() -> bool:
    """Whether this package is being imported only as the parent of a submodule that imports no Lightning.

    ``import lightning_shardrec.sparse`` (or ``python -m lightning_shardrec.inference...``) runs this
    ``__init__`` first, from inside the import of that submodule: a frame of
    ``importlib._bootstrap._find_and_load_unlocked`` (or ``runpy._get_module_details``) further up
    holds its name (CPython 3.3 to 3.14). Where no such frame is found the answer is False: the
    strategy is registered, the safe side.
    """
    frame = sys._getframe(1) if hasattr(sys, "_getframe") else None
    while frame is not None:
        name = None
        if frame.f_code.co_name == "_find_and_load_unlocked":
            name = frame.f_locals.get("name")
        elif frame.f_code.co_name == "_get_module_details":
            name = frame.f_locals.get("mod_name")
        if isinstance(name, str) and name.startswith(f"{__name__}."):
            return name.split(".")[1] in _LIGHTNING_FREE
        frame = frame.f_back
    return False


# The one thing importing the package does: strategy="shardrec" is registered with Lightning. A Lightning-free
# submodule imported alone (serving, data, planning) imports no Lightning for it, and registers where Lightning
# is imported already, or at the first public name used once it is; the Lightning layer registers when imported.
if not _imported_for_a_lightning_free_submodule():
    importlib.import_module(_STRATEGY)
else:
    _register_if_lightning_is_loaded()

# Our own TorchRec-style module paths (lightning_shardrec.<torchrec path>) we lack raise a named error
# instead of ModuleNotFoundError; the finder answers for lightning_shardrec.* names only.
_torchrec_paths.install()
