"""TorchRec's storage reservations' path (``torchrec.distributed.planner.storage_reservations``).

Defined in :mod:`lightning_shardrec.planner.machine.reservations`; ``EmbeddingShardingPlanner(storage_reservation=...)``
takes them in place of ``reserve=``.
"""

from lightning_shardrec.errors import missing_names
from lightning_shardrec.planner.machine.reservations import (
    FixedPercentageStorageReservation,
    HeuristicalStorageReservation,
    StorageReservation,
)

__getattr__ = missing_names(
    __name__,
    {
        "InferenceStorageReservation": "the planner plans training; serve with lightning_shardrec.inference, which "
        "keeps each quantized collection whole on its process",
    },
)

__all__ = ["FixedPercentageStorageReservation", "HeuristicalStorageReservation", "StorageReservation"]
