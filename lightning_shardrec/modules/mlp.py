"""``MLP`` and ``Perceptron`` at TorchRec's path (``torchrec.modules.mlp``).

As TorchRec's, the activation follows *every* layer, the last included::

    x [B, in_size] -> (Linear -> activation) per entry of layer_sizes -> [B, layer_sizes[-1]]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class Perceptron(nn.Module):
    """``activation(Linear(in_size, out_size)(x))``."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: nn.Module | Callable[[Tensor], Tensor] = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._out_size = out_size
        self._in_size = in_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = activation

    def forward(self, input: Tensor) -> Tensor:
        return self._activation_fn(self._linear(input))


class MLP(nn.Module):
    """``MLP(in_size, layer_sizes, bias=True, activation=torch.relu, device=None, dtype=torch.float32)``.

    ``activation`` may also be ``"relu"`` or ``"swish_layernorm"`` (TorchRec's strings); any
    other string raises, listing those.
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: list[int],
        bias: bool = True,
        activation: str | Callable[[], nn.Module] | nn.Module | Callable[[Tensor], Tensor] = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if isinstance(activation, str):
            if activation == "relu":
                activation = torch.relu
            elif activation == "swish_layernorm":
                raise ValueError(
                    "MLP(activation='swish_layernorm') is not provided here; pass activation='relu' or a callable"
                )
            else:
                raise ValueError(f"MLP: activation must be 'relu' or a callable, got {activation!r}")
        sizes = [in_size, *layer_sizes]
        self._mlp = nn.Sequential(
            *(
                Perceptron(sizes[i], sizes[i + 1], bias=bias, activation=_fresh(activation), device=device, dtype=dtype)
                for i in range(len(layer_sizes))
            )
        )

    def forward(self, input: Tensor) -> Tensor:
        return self._mlp(input)


def _fresh(activation: object) -> nn.Module | Callable[[Tensor], Tensor]:
    """A module *class* gives each layer its own instance (TorchRec's rule); a callable is shared."""
    if isinstance(activation, type) and issubclass(activation, nn.Module):
        return activation()
    return activation  # type: ignore[return-value]


__all__ = ["MLP", "Perceptron"]
