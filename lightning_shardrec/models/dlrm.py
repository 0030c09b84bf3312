"""DLRM (Naumov et al. 2019) on an :class:`EmbeddingBagCollection`, as in TorchRec.

::

    dense [B, D_in] --DenseArch (MLP)--> [B, D]  ----------+
    sparse KJT --EBC--> pooled [B, F, D] ------------------+--> interaction --OverArch--> logits [B, 1]

Interactions (``INTERACTIONS``):

- ``"dot"`` (TorchRec's): pairwise dot products of the ``F + 1`` vectors
  (upper triangle, no diagonal), concatenated with the dense vector:
  ``D + F * (F + 1) / 2`` wide. Needs every table and the dense output of width ``D``.
- ``"concat"``: the dense vector and every pooled vector side by side:
  ``D + sum(table dims)`` wide (the benchmark workload: 64 + 8 * 64 = 576).

Plain ``nn.Module``s: nothing here knows about sharding or Lightning; the strategy
replaces the EBC in place and the forward is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.errors import missing_names, unknown_name
from lightning_shardrec.modules import EmbeddingBagCollection
from lightning_shardrec.sparse import KeyedJaggedTensor


def mlp(in_features: int, layer_sizes: Sequence[int], *, last_activation: bool = True) -> nn.Sequential:
    """``Linear -> ReLU`` per entry of ``layer_sizes`` (no ReLU after the last when ``last_activation=False``)."""
    if not layer_sizes or any(not isinstance(s, int) or s <= 0 for s in layer_sizes):
        raise ValueError(f"MLP layer sizes must be a non-empty list of positive ints, got {list(layer_sizes)!r}")
    layers: list[nn.Module] = []
    for i, size in enumerate(layer_sizes):
        layers.append(nn.Linear(in_features, size))
        if last_activation or i < len(layer_sizes) - 1:
            layers.append(nn.ReLU())
        in_features = size
    return nn.Sequential(*layers)


class SparseArch(nn.Module):
    """``KJT -> [B, F, D]``: the pooled embedding of every feature (all tables of one dim ``D``)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        self.feature_dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        self.num_features = len(self.feature_dims)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """``[B, sum(dims)]`` pooled embeddings, features in table order."""
        return self.embedding_bag_collection(features).values()


class DotInteraction(nn.Module):
    """``[B, D]`` dense, ``[B, F * D]`` sparse -> ``[B, D + F (F + 1) / 2]``."""

    rows: Tensor
    cols: Tensor

    def __init__(self, num_sparse_features: int, dim: int) -> None:
        super().__init__()
        self.num_features, self.dim = num_sparse_features, dim
        rows, cols = torch.triu_indices(num_sparse_features + 1, num_sparse_features + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.out_features = dim + len(rows)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        stacked = torch.cat([dense.unsqueeze(1), sparse.view(-1, self.num_features, self.dim)], dim=1)
        pairs = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F + 1, F + 1]
        return torch.cat([dense, pairs[:, self.rows, self.cols]], dim=1)


class ConcatInteraction(nn.Module):
    """``[B, D]`` dense, ``[B, S]`` sparse -> ``[B, D + S]``."""

    def __init__(self, dense_dim: int, sparse_dim: int) -> None:
        super().__init__()
        self.out_features = dense_dim + sparse_dim

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        return torch.cat([dense, sparse], dim=1)


INTERACTIONS = ("dot", "concat")


def make_interaction(kind: str, dense_dim: int, feature_dims: Sequence[int]) -> DotInteraction | ConcatInteraction:
    """The interaction ``kind`` (one of :data:`INTERACTIONS`) for these widths."""
    if kind == "concat":
        return ConcatInteraction(dense_dim, sum(feature_dims))
    if kind != "dot":
        raise unknown_name("DLRM interaction", kind, list(INTERACTIONS))
    bad = sorted({d for d in feature_dims if d != dense_dim})
    if bad:
        raise ValueError(
            f"DLRM(interaction='dot'): every table's embedding_dim must equal the dense arch output "
            f"(dense_arch_layer_sizes[-1] = {dense_dim}), got table dims {bad}; "
            "change dense_arch_layer_sizes or use interaction='concat'"
        )
    return DotInteraction(len(feature_dims), dense_dim)


class DLRM(nn.Module):
    """``forward(dense [B, D_in], sparse KJT) -> logits [B, 1]``.

    Args:
        embedding_bag_collection: the tables (any sharding; replaced in place by the strategy).
        dense_in_features: ``D_in``, the number of dense features.
        dense_arch_layer_sizes: bottom MLP, e.g. ``[128, 64]``; the last is ``D``.
        over_arch_layer_sizes: top MLP, ending in ``1`` (no activation after it).
        dense_device: where the dense arches live (TorchRec's); None: the default device.
        interaction: ``"dot"`` (TorchRec's DLRM) or ``"concat"``.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dense_device: torch.device | str | None = None,
        interaction: str = "dot",
    ) -> None:
        super().__init__()
        check_over_arch(over_arch_layer_sizes)
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = mlp(dense_in_features, dense_arch_layer_sizes)
        self.inter_arch = make_interaction(interaction, dense_arch_layer_sizes[-1], self.sparse_arch.feature_dims)
        self.over_arch = mlp(self.inter_arch.out_features, over_arch_layer_sizes, last_activation=False)
        if dense_device is not None:  # TorchRec's: the dense arches there, the tables where they were built
            for arch in (self.dense_arch, self.inter_arch, self.over_arch):
                arch.to(dense_device)

    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        x = self.inter_arch(self.dense_arch(dense_features), self.sparse_arch(sparse_features))
        return self.over_arch(x)


def check_over_arch(layer_sizes: Sequence[int]) -> None:
    """The top MLP must end in one logit."""
    if not layer_sizes or layer_sizes[-1] != 1:
        raise ValueError(f"over_arch_layer_sizes must end in 1 (one logit per sample), got {list(layer_sizes)!r}")


class DLRMTrain(nn.Module):
    """TorchRec's training wrapper: ``forward(batch) -> (loss, (loss, logits, labels))``, all detached but ``loss``.

    ``batch`` has ``dense_features``, ``sparse_features`` and ``labels`` (a
    :class:`~lightning_shardrec.compat.torchrec.datasets.utils.Batch`; a ``RecBatch`` works too). The loss is
    ``BCEWithLogitsLoss`` over the ``[B]`` logits.
    """

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        logits = self.model(batch.dense, batch.sparse).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


__getattr__ = missing_names(
    __name__,
    {
        "DenseArch": "the dense arch is a plain MLP here (DLRM.dense_arch); build one with models.dlrm.mlp",
        "OverArch": "the over arch is a plain MLP here (DLRM.over_arch)",
        "InteractionArch": "DLRM(interaction='dot') is TorchRec's interaction (DLRM.inter_arch)",
        "InteractionDCNArch": "use lightning_shardrec.models.DCNv2",
        "InteractionProjectionArch": "the projection interaction is not implemented",
        "DLRM_DCN": "use lightning_shardrec.models.DCNv2",
        "DLRM_Projection": "the projection interaction is not implemented",
    },
)
