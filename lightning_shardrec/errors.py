"""Library exception types.

Bad user input raises ``ValueError`` (or ``KeyError`` for a missing name) with a
message that names the table/feature, the value and the valid range. The classes
here mark failures of a whole stage, so callers can catch them by kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


class ShardRecError(RuntimeError):
    """Base class of lightning_shardrec's own failures."""


class PlannerError(ShardRecError, ValueError):
    """No sharding plan satisfies the tables, constraints and topology (or a given plan is invalid)."""


class ShardingError(ShardRecError, ValueError):
    """A sharded module got input it was not planned for (keys, batch size, world size)."""


class CheckpointError(ShardRecError, ValueError):
    """A checkpoint does not match the model it is loaded into."""


class UnsupportedFeatureError(ShardRecError, NotImplementedError):
    """A TorchRec argument or field this library does not implement; the message names it and the alternative."""


def unknown_name(kind: str, name: object, available: list[str]) -> ValueError:
    """``ValueError`` for a lookup by name that failed, listing what is available."""
    return ValueError(f"unknown {kind} {name!r}; available: {', '.join(available)}")


class NonFiniteError(ShardRecError, FloatingPointError):
    """A NaN/inf reached (or came out of) a fused embedding update; the message names the table."""


class UnevenBatchesError(ShardingError):
    """Ranks ran different numbers of batches into one sharded module; the message names the ranks and counts."""


class CollectiveCallError(ShardRecError):
    """A collective sharded forward was called where the other ranks cannot be taking part."""


class ShardedStateError(ShardRecError):
    """A sharded module's ``state_dict()`` was asked for where only the full (gathered) one is meaningful."""


class ShardedWeightError(ShardedStateError, AttributeError):
    """``.weight`` of a sharded plain ``nn.Embedding``/``nn.EmbeddingBag``: no rank holds the whole table."""


class IdOutOfRangeError(ShardRecError, ValueError):
    """An id outside its table's ``[0, num_embeddings)``: a data error (the message names feature, table, id, range)."""

    def __init__(self, message: str, *, feature: str = "", value: int = 0) -> None:
        super().__init__(message)
        self.feature, self.value = feature, value


class RepeatedLookupError(ShardRecError):
    """A fused table was looked up more than once in one training step where the step's row gradients
    cannot be summed before its one update; the message names the tables and the way out."""


class PrefetchedBatchEditedError(ShardRecError):
    """A batch's KJT was changed in place after the pipeline started its input distribution (the ids sent
    would be stale); the message names the collection, the features, and the two ways out."""


class DynamicTableFullWarning(UserWarning):
    """A dynamic table missed more of its lookups than the threshold over a window: it is too small."""


class MissingTorchRecFeatureError(UnsupportedFeatureError, ImportError):
    """A TorchRec module path or name this library does not provide (also an ``ImportError``, so ``from x import
    y`` fails as Python's own would); the message names it and the ``docs/migrating.md`` section."""


def missing_names(module: str, names: dict[str, str]) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` that refuses TorchRec's ``names`` (name -> why / what to use) by name.

    Any other unknown attribute raises ``AttributeError`` as usual (``hasattr`` keeps working).
    """

    # a mirror in compat/torchrec/ is served at TorchRec's path: its messages name that path
    module = module.replace("lightning_shardrec.compat.torchrec.", "lightning_shardrec.", 1)

    def __getattr__(name: str) -> NoReturn:
        if name in names:
            raise MissingTorchRecFeatureError(
                f"{module}.{name} (TorchRec's {module.replace('lightning_shardrec', 'torchrec', 1)}.{name}) is not "
                f"provided: {names[name]}. See docs/migrating.md, 'Not provided'"
            )
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
