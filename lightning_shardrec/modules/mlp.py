"""``MLP`` and ``Perceptron`` at TorchRec's path (``torchrec.modules.mlp``).

As TorchRec's, the activation follows every layer, the last included unless ``activation_on_last=False``::

    x [B, in_size] -> (Linear -> activation) per entry of layer_sizes -> [B, layer_sizes[-1]]

Annotations are evaluated objects (no postponed strings), so a traced MLP scripts as TorchRec's does.
"""

import inspect
from collections.abc import Callable

import torch
from torch import nn

from lightning_shardrec.modules.activation import SwishLayerNorm

Activation = nn.Module | Callable[[torch.Tensor], torch.Tensor]


class Perceptron(nn.Module):
    """``activation(Linear(in_size, out_size)(x))``: ``[B, in_size] -> [B, out_size]``."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._out_size = out_size
        self._in_size = in_size
        self._linear: nn.Linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn: Callable[[torch.Tensor], torch.Tensor] = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._activation_fn(self._linear(input))


class MLP(nn.Module):
    """``MLP(in_size, layer_sizes, bias=True, activation=torch.relu, device=None, dtype=torch.float32,
    activation_on_last=True)``.

    ``activation``: ``"relu"``, ``"sigmoid"`` or ``"swish_layernorm"`` (a
    :class:`~lightning_shardrec.modules.activation.SwishLayerNorm` per layer), a module class or a factory
    taking no arguments (called once per layer, so layers do not share parameters), or a module or tensor
    function shared by every layer.
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: list[int],
        bias: bool = True,
        activation: str | Callable[[], nn.Module] | nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        sizes = [in_size, *layer_sizes]
        last = len(layer_sizes) - 1

        def layer_activation(i: int) -> Activation:
            if not activation_on_last and i == last:
                return nn.Identity()
            if activation == "swish_layernorm":
                return SwishLayerNorm(layer_sizes[i], device=device)
            if isinstance(activation, str):
                return _NAMED[_known(activation)]
            return _per_layer(activation)

        self._mlp: nn.Module = nn.Sequential(
            *(
                Perceptron(sizes[i], sizes[i + 1], bias, layer_activation(i), device=device, dtype=dtype)
                for i in range(len(layer_sizes))
            )
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)


_NAMED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": torch.relu, "sigmoid": torch.sigmoid}


def _known(name: str) -> str:
    if name not in _NAMED:
        raise ValueError(f"MLP: activation must be 'relu', 'sigmoid', 'swish_layernorm' or a callable, got {name!r}")
    return name


def _per_layer(activation: object) -> Activation:
    """TorchRec's rule: a module class or a factory taking no arguments is called for each layer (its own
    parameters); a module instance or a tensor function (``torch.relu``) is shared by every layer."""
    if isinstance(activation, nn.Module):
        return activation
    if isinstance(activation, type) and issubclass(activation, nn.Module):
        return activation()
    if not callable(activation):
        raise TypeError(f"MLP: activation must be a string, a module or a callable, got {type(activation).__name__}")
    try:
        takes_input = any(
            p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            for p in inspect.signature(activation).parameters.values()
        )
    except (TypeError, ValueError):  # builtins such as torch.relu have no signature: a tensor function
        takes_input = True
    if takes_input:
        return activation  # type: ignore[return-value]
    made = activation()
    if not isinstance(made, nn.Module):
        raise ValueError(
            f"MLP: an activation factory taking no input must return a torch.nn.Module, got {type(made).__name__}"
        )
    return made


__all__ = ["MLP", "Perceptron"]
