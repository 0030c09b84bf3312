"""DCNv2 (Wang et al. 2021): a cross network over ``concat(dense, pooled embeddings)``.

::

    x_0 = concat(DenseArch(dense) [B, D], pooled [B, S])        [B, N], N = D + S
    x_{l+1} = x_0 * (W_l x_l + b_l) + x_l                       l = 0 .. num_layers - 1
    W_l = U_l V_l  (U_l [N, r], V_l [r, N]) when low_rank = r   (TorchRec's LowRankCrossNet)
    logits = OverArch(x_L)                                       [B, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lightning_shardrec.models.dlrm import ConcatInteraction, SparseArch, check_over_arch, mlp
from lightning_shardrec.modules import EmbeddingBagCollection
from lightning_shardrec.sparse import KeyedJaggedTensor


class CrossNet(nn.Module):
    """``[B, N] -> [B, N]``: ``num_layers`` cross layers, full rank or rank ``low_rank``."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int | None = None) -> None:
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"CrossNet: num_layers must be an int >= 1, got {num_layers!r}")
        if low_rank is not None and not (isinstance(low_rank, int) and 1 <= low_rank <= in_features):
            raise ValueError(
                f"CrossNet: low_rank must be None (full rank) or an int in [1, {in_features}] "
                f"(the input width), got {low_rank!r}"
            )
        self.in_features, self.num_layers, self.low_rank = in_features, num_layers, low_rank
        if low_rank is None:
            self.weights = nn.ModuleList(nn.Linear(in_features, in_features) for _ in range(num_layers))
        else:
            self.weights = nn.ModuleList(
                nn.Sequential(nn.Linear(in_features, low_rank, bias=False), nn.Linear(low_rank, in_features))
                for _ in range(num_layers)
            )

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for layer in self.weights:
            x = x0 * layer(x) + x
        return x


class DCNv2(nn.Module):
    """``forward(dense [B, D_in], sparse KJT) -> logits [B, 1]`` with a cross network interaction.

    Args as :class:`~lightning_shardrec.models.DLRM`, plus ``dcn_num_layers`` and
    ``dcn_low_rank_dim`` (``None``: full-rank cross layers).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int | None = None,
    ) -> None:
        super().__init__()
        check_over_arch(over_arch_layer_sizes)
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = mlp(dense_in_features, dense_arch_layer_sizes)
        self.inter_arch = ConcatInteraction(dense_arch_layer_sizes[-1], sum(self.sparse_arch.feature_dims))
        self.crossnet = CrossNet(self.inter_arch.out_features, dcn_num_layers, dcn_low_rank_dim)
        self.over_arch = mlp(self.inter_arch.out_features, over_arch_layer_sizes, last_activation=False)

    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        x0 = self.inter_arch(self.dense_arch(dense_features), self.sparse_arch(sparse_features))
        return self.over_arch(self.crossnet(x0))


__all__ = ["CrossNet", "DCNv2"]
