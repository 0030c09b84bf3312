"""TorchRec's ``torchrec.datasets`` paths: the random dataset, the ``Batch`` type and Criteo's column names.

This library's own data layer (Criteo readers, synthetic data, DataModules) is
:mod:`lightning_shardrec.data`.
"""

from lightning_shardrec.compat.torchrec.datasets.random import RandomRecDataset
from lightning_shardrec.compat.torchrec.datasets.utils import Batch

__all__ = ["Batch", "RandomRecDataset"]
