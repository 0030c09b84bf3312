"""Sharded forms of the plain-module adapters (:mod:`lightning_shardrec.modules.plain_embeddings`).

Each is a sharded one-table collection that keeps the torch module's call
(``bag(input, offsets, per_sample_weights)``, ``emb(input)``) and saves its table under the
module's own key, ``<path>.weight``, as the plain model does.
"""

from __future__ import annotations

from typing import Any

from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.sharded.embedding import ShardedEmbeddingCollection
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection
from lightning_shardrec.distributed.sharding import KernelSetup
from lightning_shardrec.errors import ShardedWeightError
from lightning_shardrec.modules.plain_embeddings import (
    EmbeddingBagCall,
    EmbeddingCall,
    PlainEmbedding,
    PlainEmbeddingBag,
    PlainMaxEmbeddingBag,
)
from lightning_shardrec.planner import ParameterSharding


def _rows_of(module: Any) -> int | str:
    """The table's rows (its config), or ``N`` when the module cannot tell yet."""
    try:
        return int(module.table_configs()[0].num_embeddings)
    except (AttributeError, IndexError):
        return "N"


class _ShardedPlain:
    """What the three sharded plain modules share: the torch module's ``spec``, the table saved under
    ``<path>.weight``, and ``.weight`` a named error (this rank holds only shards of the table: an
    ``AttributeError``, so ``hasattr`` is False and ``getattr(m, "weight", None)`` is None, with a message).
    """

    weight_prefix = ""

    def __init__(
        self,
        module: PlainEmbeddingBag | PlainMaxEmbeddingBag | PlainEmbedding,
        plan: dict[str, ParameterSharding],
        env: ShardingEnv,
        setup: KernelSetup,
    ) -> None:
        super().__init__(module, plan, env, setup)  # type: ignore[call-arg]
        self.spec = module.spec

    def state_key(self, table: str) -> str:
        return "weight"

    def __getattr__(self, name: str) -> Any:
        if name == "weight":
            spec = self.spec  # type: ignore[attr-defined]
            path, rows = spec.path, _rows_of(self)
            every_row = f"self.{path}(torch.arange({rows}))"
            if spec.kind == "EmbeddingBag":  # one bag per row: offsets = arange too
                every_row = f"self.{path}(torch.arange({rows}), torch.arange({rows}))"
            raise ShardedWeightError(
                f"{spec.where}.weight: the table is sharded, so no rank holds it whole. To score every row "
                f"(e.g. all items in predict_step), look them all up in one call on every rank: {every_row} "
                "returns the whole table, exact (docs/existing-models.md, 'Reading a whole table'). To read the "
                f"weights: DistributedModelParallel.state_dict()['{path}.weight'] (a ShardedTensor of this rank's "
                "shards), .full_state_dict() (collective, the whole table) or .local_shards(); under the Trainer, "
                "trainer.strategy.full_state_dict()"
            )
        return super().__getattr__(name)  # type: ignore[misc]


class ShardedPlainEmbeddingBag(_ShardedPlain, EmbeddingBagCall, ShardedEmbeddingBagCollection):  # type: ignore[misc]  # nn.Embedding(Bag)'s call, not a KJT's
    """A sharded ``nn.EmbeddingBag`` (mode sum/mean): same call, same result, ``<path>.weight`` in checkpoints."""


class ShardedPlainMaxEmbeddingBag(_ShardedPlain, EmbeddingBagCall, ShardedEmbeddingCollection):  # type: ignore[misc]  # nn.Embedding(Bag)'s call, not a KJT's
    """A sharded ``nn.EmbeddingBag(mode="max")``: rows per id, max-pooled after the output distribution."""


class ShardedPlainEmbedding(_ShardedPlain, EmbeddingCall, ShardedEmbeddingCollection):  # type: ignore[misc]  # nn.Embedding(Bag)'s call, not a KJT's
    """A sharded ``nn.Embedding``: same call (any input shape), same result."""
