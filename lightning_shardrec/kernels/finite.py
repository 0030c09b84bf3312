"""Optional NaN/inf checks around fused embedding kernels.

A non-finite gradient that reaches a fused kernel is written into the table rows
in backward, with no optimizer step in between that could skip it, and poisons
every later batch that reads those rows. ``FiniteGuard`` checks, per kernel:

* in backward, the output gradient *before* the kernel applies it (one
  ``isfinite`` over ``[B, sum D]``); on failure it raises naming the feature and
  table, and no row of that kernel has been touched;
* after backward (:meth:`check_rows`), the rows the batch updated (a gather of
  the ids just looked up), which catches an update rule that overflowed (an
  lr or eps that makes the step itself non-finite).

Each check synchronises with the device once; the rows check costs about one
extra lookup. Off unless asked for (``ShardRecStrategy(check_finite=True)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_shardrec.errors import NonFiniteError
from lightning_shardrec.kernels.base import BatchedEmbeddingKernel
from lightning_shardrec.sparse import KeyedJaggedTensor


class FiniteGuard:
    """Watch ``kernels``' gradients and updated rows for NaN/inf (see the module docstring)."""

    def __init__(self, kernels: list[BatchedEmbeddingKernel]) -> None:
        self._handles: list[RemovableHandle] = [k.register_forward_hook(self._on_forward) for k in kernels]
        self._batches: list[tuple[BatchedEmbeddingKernel, KeyedJaggedTensor]] = []

    def _on_forward(self, kernel: Any, args: tuple[Any, ...], out: Tensor) -> None:
        if not (torch.is_grad_enabled() and out.requires_grad):
            return
        kjt: KeyedJaggedTensor = args[0]
        self._batches.append((kernel, kjt))
        out.register_hook(lambda grad: _check_grad(kernel, kjt, grad))

    def check_rows(self) -> None:
        """After backward: every row the last batches updated is finite (raises otherwise)."""
        batches, self._batches = self._batches, []
        for kernel, kjt in batches:
            weights = kernel.split_weights()
            ids = kjt.values().long().split(kjt.length_per_key())
            for feature, feature_ids in enumerate(ids):
                if feature_ids.numel() == 0:
                    continue
                table = kernel.feature_table[feature]
                rows = weights[table].index_select(0, feature_ids)
                if not bool(torch.isfinite(rows).all()):
                    bad = int(feature_ids[(~torch.isfinite(rows)).any(1)][0])
                    raise NonFiniteError(
                        f"table '{kernel.tables[table].name}' (feature '{kjt.keys()[feature]}'): row {bad} is "
                        f"non-finite after its fused {kernel.optimizer.value} update (lr={kernel.hparams['lr']}, "
                        f"eps={kernel.hparams['eps']}); the gradient was finite, so the update rule overflowed"
                    )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._batches = []


def _check_grad(kernel: BatchedEmbeddingKernel, kjt: KeyedJaggedTensor, grad: Tensor) -> None:
    if bool(torch.isfinite(grad).all()):
        return
    # pooled [B, sum D]: feature f owns its dim's columns; sequence [N, D]: its ids' rows
    pieces = grad.split(kernel.feature_dims, dim=1) if kernel.pooled else grad.split(kjt.length_per_key(), dim=0)
    feature = next(f for f, piece in enumerate(pieces) if not bool(torch.isfinite(piece).all()))
    table = kernel.tables[kernel.feature_table[feature]].name
    kind = "nan" if bool(pieces[feature].isnan().any()) else "inf"
    raise NonFiniteError(
        f"table '{table}' (feature '{kjt.keys()[feature]}'): the gradient reaching its fused update holds {kind}; "
        "the table was not updated with it. Look for a non-finite loss or dense layer output in this step"
    )


def check_loss(loss: Tensor, step: int) -> None:
    """Raise ``NonFiniteError`` when ``loss`` is NaN/inf, before backward reaches any table."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteError(
            f"the loss is {loss.detach().flatten()[0].item()} at step {step}; stopped before backward, "
            "so no embedding table was updated with it"
        )
