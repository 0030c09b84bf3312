"""``SwishLayerNorm`` at TorchRec's path (``torchrec.modules.activation``): ``Y = X * sigmoid(LayerNorm(X))``."""

import torch
from torch import nn


class SwishLayerNorm(nn.Module):
    """Swish gated by a layer norm over ``input_dims`` (the last dims of the input): ``[..., *input_dims]`` in
    and out. Parameters: ``norm.0.weight`` / ``norm.0.bias`` (the ``LayerNorm``), as TorchRec's."""

    def __init__(self, input_dims: int | list[int] | torch.Size, device: torch.device | None = None) -> None:
        super().__init__()
        self.norm: nn.Sequential = nn.Sequential(nn.LayerNorm(input_dims, device=device), nn.Sigmoid())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input * self.norm(input)


__all__ = ["SwishLayerNorm"]
