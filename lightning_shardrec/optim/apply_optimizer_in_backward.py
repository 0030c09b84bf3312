"""``apply_optimizer_in_backward`` at TorchRec's path (``torchrec.optim.apply_optimizer_in_backward``).

On plain parameters it is torch's ``_apply_optimizer_in_backward``: each parameter steps its own
optimizer as soon as its gradient is ready. On the weights of an embedding collection it also
chooses the tables' fused optimizer: ``DistributedModelParallel`` / ``ShardRecStrategy`` read the
class and kwargs back (:func:`~lightning_shardrec.optim.fused_settings.in_backward_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    optimizer_kwargs: dict[str, Any],
) -> None:
    """Step ``optimizer_class(**optimizer_kwargs)`` on each of ``params`` inside backward.

    Example (one bag of 3 ids of one row, loss = sum of the pooled output, ``SGD(lr=0.5)``):
    every element of that row moves by ``-0.5 * 3 = -1.5``.
    """
    # imported here: torch.distributed.optim scripts its functional optimizers at import (slow, and a
    # DeprecationWarning from torch.jit.script), which importing this library must not pay
    from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(optimizer_class=optimizer_class, params=params, optimizer_kwargs=optimizer_kwargs)


__all__ = ["apply_optimizer_in_backward"]
