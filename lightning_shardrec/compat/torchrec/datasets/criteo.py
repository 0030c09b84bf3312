"""Criteo's column names at TorchRec's path (``torchrec.datasets.criteo``); readers: :mod:`lightning_shardrec.data`."""

from __future__ import annotations

from lightning_shardrec.data.criteo import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from lightning_shardrec.errors import missing_names

INT_FEATURE_COUNT = NUM_DENSE
CAT_FEATURE_COUNT = NUM_SPARSE
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: list[str] = list(DENSE_NAMES)
DEFAULT_CAT_NAMES: list[str] = list(SPARSE_NAMES)
DEFAULT_COLUMN_NAMES: list[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]

_READERS = "read Criteo with lightning_shardrec.data (CriteoReader, CriteoDataModule, the binary format)"
__getattr__ = missing_names(
    __name__,
    {
        "criteo_terabyte": _READERS,
        "criteo_kaggle": _READERS,
        "CriteoIterDataPipe": _READERS,
        "BinaryCriteoUtils": _READERS,
        "InMemoryBinaryCriteoIterDataPipe": _READERS,
    },
)

__all__ = [
    "CAT_FEATURE_COUNT",
    "DAYS",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_COLUMN_NAMES",
    "DEFAULT_INT_NAMES",
    "DEFAULT_LABEL_NAME",
    "INT_FEATURE_COUNT",
]
