"""MovieLens column names at TorchRec's path (``torchrec.datasets.movielens``); no MovieLens loader is provided."""

from __future__ import annotations

from lightning_shardrec.errors import missing_names

RATINGS_FILENAME = "ratings.csv"
MOVIES_FILENAME = "movies.csv"
DEFAULT_RATINGS_COLUMN_NAMES: list[str] = ["userId", "movieId", "rating", "timestamp"]
DEFAULT_MOVIES_COLUMN_NAMES: list[str] = ["movieId", "title", "genres"]
DEFAULT_COLUMN_NAMES: list[str] = DEFAULT_RATINGS_COLUMN_NAMES + DEFAULT_MOVIES_COLUMN_NAMES[1:]

_LOADER = "no MovieLens loader is provided; read the CSV with pandas and build KeyedJaggedTensors"
__getattr__ = missing_names(__name__, {"movielens_20m": _LOADER, "movielens_25m": _LOADER})

__all__ = [
    "DEFAULT_COLUMN_NAMES",
    "DEFAULT_MOVIES_COLUMN_NAMES",
    "DEFAULT_RATINGS_COLUMN_NAMES",
    "MOVIES_FILENAME",
    "RATINGS_FILENAME",
]
