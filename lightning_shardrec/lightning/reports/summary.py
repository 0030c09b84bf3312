"""Lightning's model summary with the sharded tables at their full size.

Lightning's ``ModelSummary`` (the table printed at the start of ``fit``) counts
``module.parameters()``; a sharded collection's tables live in its kernels as this rank's shards,
so they counted 0 (and a data-parallel table its full size). :class:`ShardedModelSummary` adds
each sharded collection's full tables (rows x dim of every table, less what the collection
already holds as parameters) to its layer, to the totals and to the model size; the strategy
makes the Trainer's summary callbacks (``ModelSummary``, ``RichModelSummary``) print it during
its fits (:func:`~lightning_shardrec.lightning.pl_compat.summarize_through`). Outside the Trainer::

    print(ShardedModelSummary(model, max_depth=1, sharded=trainer.strategy.sharded))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from lightning_shardrec.lightning.pl_compat import summarize_plain, summarize_through


def unheld_numel(coll: nn.Module) -> int:
    """A sharded collection's full tables' elements less those it holds as parameters (0 for an unsharded one)."""
    configs = getattr(coll, "table_configs", None)
    if configs is None:
        return 0
    full = sum(c.num_embeddings * c.embedding_dim for c in configs())
    return max(0, full - sum(p.numel() for p in coll.parameters()))


class ShardedModelSummary(ModelSummary):
    """``ModelSummary`` counting each sharded collection (``sharded``: path -> module) at its full size."""

    def __init__(self, model: LightningModule, max_depth: int = 1, sharded: Mapping[str, nn.Module] | None = None):
        self._unheld = {path: unheld_numel(coll) for path, coll in (sharded or {}).items()}
        super().__init__(model, max_depth)

    def _under(self, name: str) -> int:
        return sum(n for path, n in self._unheld.items() if path == name or path.startswith(f"{name}."))

    @property
    def param_nums(self) -> list[int]:
        return [n + self._under(name) for name, n in zip(self.layer_names, super().param_nums, strict=True)]

    @property
    def total_parameters(self) -> int:
        return super().total_parameters + sum(self._unheld.values())

    @property
    def trainable_parameters(self) -> int:  # the sharded tables train (fused updates)
        return super().trainable_parameters + sum(self._unheld.values())


def install(trainer: Any, sharded: Mapping[str, nn.Module]) -> None:
    """During a fit: the trainer's summary callbacks print :class:`ShardedModelSummary` (undo: :func:`remove`)."""
    if sharded:
        summarize_through(trainer, lambda module, depth: ShardedModelSummary(module, depth, sharded))


def remove(trainer: Any) -> None:
    summarize_plain(trainer)
