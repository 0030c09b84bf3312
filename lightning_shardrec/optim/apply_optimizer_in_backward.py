"""``apply_optimizer_in_backward`` at TorchRec's path (``torchrec.optim.apply_optimizer_in_backward``).

On plain parameters it is torch's ``_apply_optimizer_in_backward`` (through :mod:`lightning_shardrec._compat.torch`):
each parameter steps its own optimizer as soon as its gradient is ready. On the weights of an embedding collection
it also chooses the tables' fused optimizer: ``DistributedModelParallel`` / ``ShardRecStrategy`` read the class
and kwargs back (:func:`~lightning_shardrec.optim.fused_settings.in_backward_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_shardrec._compat import torch as compat


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    optimizer_kwargs: dict[str, Any],
) -> None:
    """Step ``optimizer_class(**optimizer_kwargs)`` on each of ``params`` inside backward.

    Example (one bag of 3 ids of one row, loss = sum of the pooled output, ``SGD(lr=0.5)``):
    every element of that row moves by ``-0.5 * 3 = -1.5``.
    """
    # torch.distributed.optim is imported on this call: it scripts its functional optimizers at import (slow, and a
    # DeprecationWarning from torch.jit.script), which importing this library must not pay
    compat.apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)


__all__ = ["apply_optimizer_in_backward"]
