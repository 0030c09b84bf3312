"""Data: :class:`RecBatch`, the synthetic generator, the Criteo reader, and the DataModules.

The DataModules import Lightning, so they load lazily on first access; the rest
of this package does not import Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_shardrec.data.batch import RecBatch
from lightning_shardrec.data.criteo import (
    CriteoChunk,
    CriteoReader,
    criteo_tables,
    find_criteo_files,
)
from lightning_shardrec.data.criteo_binary import (
    CriteoBinary,
    CriteoBinaryDataset,
    CriteoMeta,
    preprocess_criteo,
)
from lightning_shardrec.data.loader import IndexedBatchDataset, RecBatchLoader
from lightning_shardrec.data.synthetic import (
    FeatureSpec,
    SyntheticRecDataset,
    SyntheticRecGenerator,
    SyntheticSpec,
    benchmark_features,
    benchmark_tables,
)

if TYPE_CHECKING:
    from lightning_shardrec.data.datamodule import CriteoDataModule, SyntheticRecDataModule

_LAZY = ("CriteoDataModule", "SyntheticRecDataModule")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from lightning_shardrec.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module 'lightning_shardrec.data' has no attribute {name!r}")


__all__ = [
    "CriteoBinary",
    "CriteoBinaryDataset",
    "CriteoChunk",
    "CriteoDataModule",
    "CriteoMeta",
    "CriteoReader",
    "FeatureSpec",
    "IndexedBatchDataset",
    "RecBatch",
    "RecBatchLoader",
    "SyntheticRecDataModule",
    "SyntheticRecDataset",
    "SyntheticRecGenerator",
    "SyntheticSpec",
    "benchmark_features",
    "benchmark_tables",
    "criteo_tables",
    "find_criteo_files",
    "preprocess_criteo",
]
