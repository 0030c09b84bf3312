"""What both sharded collections (pooled and sequence) share: their tables and shards."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.distributed.sharding import EmbeddingSharding
from lightning_shardrec.kernels import BatchedEmbeddingKernel
from lightning_shardrec.planner import ShardMetadata


class ShardedCollection(nn.Module):
    """Base of the sharded collections: ``groups`` of shardings over ``_configs`` tables."""

    #: state-dict prefix of the unsharded module's tables (``embedding_bags`` / ``embeddings``)
    weight_prefix: str
    groups: nn.ModuleList
    _configs: list
    _feature_names: list[str]

    def table_configs(self) -> list[BaseEmbeddingConfig]:
        return self._configs

    def feature_names(self) -> list[str]:
        return self._feature_names

    def kernels(self) -> list[BatchedEmbeddingKernel]:
        return [g.kernel for g in self._groups() if g.fused and g.kernel is not None]

    def local_shards(self) -> dict[str, list[tuple[ShardMetadata, Tensor]]]:
        """``table -> [(shard metadata, [rows, cols] tensor)]`` held by this rank."""
        out: dict[str, list[tuple[ShardMetadata, Tensor]]] = {}
        for g in self._groups():
            for name, meta, w in g.local_shards():
                out.setdefault(name, []).append((meta, w))
        return out

    def local_states(self) -> dict[str, list[tuple[ShardMetadata, dict[str, Tensor]]]]:
        """``table -> [(shard metadata, fused optimizer state views)]`` held by this rank."""
        out: dict[str, list[tuple[ShardMetadata, dict[str, Tensor]]]] = {}
        for g in self._groups():
            if g.fused:
                for (name, meta, _), state in zip(g.local_shards(), g.local_states(), strict=True):
                    out.setdefault(name, []).append((meta, state))
        return out

    def _groups(self) -> list[EmbeddingSharding]:
        return list(self.groups)  # type: ignore[arg-type]
