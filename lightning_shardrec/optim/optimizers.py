"""``in_backward_optimizer_filter`` at TorchRec's path (``torchrec.optim.optimizers``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn


def in_backward_optimizer_filter(
    named_parameters: Iterable[tuple[str, nn.Parameter]], include: bool = False
) -> Iterator[tuple[str, nn.Parameter]]:
    """The ``(name, param)`` pairs trained outside backward (``include=True``: those trained inside).

    A parameter is trained inside backward when ``apply_optimizer_in_backward`` was applied to it,
    or when it is a sharded table of a :class:`~lightning_shardrec.distributed.DistributedModelParallel`
    (fused optimizer); both carry ``_in_backward_optimizers``.
    """
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param


__all__ = ["in_backward_optimizer_filter"]
