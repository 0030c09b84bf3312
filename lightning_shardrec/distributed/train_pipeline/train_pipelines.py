"""``TrainPipelineSparseDist`` at TorchRec's path: a hand-written loop with batch ``i + 1``'s input
distribution behind batch ``i``'s compute (the overlap of ``ShardRecStrategy(pipeline=True)``).

Per ``progress(dataloader_iter)`` call::

    take batch i+1 from the iterator, move it to the device, start its id all-to-alls (prefetch)
    zero_grad; (losses, output) = model(batch i)   the collections find batch i's prefetched ids
    issue batch i+1's id all-to-alls; sum(losses).backward(); optimizer.step()
    return output

The first call takes two batches; once the iterator is exhausted the calls run the
batches still held, then raise ``StopIteration``. In ``model.eval()`` mode only the forward
runs. Every rank must call it the same number of times (as TorchRec's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.distributed.collection import ShardedCollection
from lightning_shardrec.distributed.groups import new_group_like
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.sparse import KeyedJaggedTensor

Held = tuple[Any, list[tuple[ShardedCollection, Any]]]


class TrainPipelineSparseDist:
    """``TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True, apply_jit=False, ...)``.

    ``model(batch)`` returns ``(losses, output)`` (e.g. :class:`~lightning_shardrec.models.dlrm.DLRMTrain`);
    ``custom_model_fwd(batch)`` replaces that call when given.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: object = None,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[Any], tuple[Tensor, Any]] | None = None,
    ) -> None:
        refused = {
            "execute_all_batches=False": not execute_all_batches,
            "apply_jit=True": apply_jit,
            "pipeline_postproc=True": pipeline_postproc,
            f"context_type={context_type!r}": context_type is not None,
        }
        for what, bad in refused.items():
            if bad:
                raise UnsupportedFeatureError(
                    f"TrainPipelineSparseDist({what}) is not supported (see docs/migrating.md, 'Pipeline')"
                )
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._forward = custom_model_fwd or model
        self._sharded = [m for m in model.modules() if isinstance(m, ShardedCollection)]
        if self._sharded:
            env = new_group_like(self._sharded[0].env)  # collective: the prefetch's own group
            for coll in self._sharded:
                coll.enable_prefetch(env)
        self._held: list[Held] = []
        self._started = False

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train one batch and return the model's ``output``; ``StopIteration`` when none is left."""
        if not self._started:
            self._started = True
            self._take(dataloader_iter)
        if not self._held:
            self._drop()
            raise StopIteration
        self._take(dataloader_iter)  # batch i + 1: moved and its input distribution started
        batch, handles = self._held.pop(0)
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        losses, output = self._forward(batch)
        for coll in self._sharded:
            coll.progress_prefetched()
        if training:
            torch.sum(losses, dim=0).backward()
            self._optimizer.step()
        for coll, handle in handles:  # not consumed: the forward got another KJT; free its buffers
            if coll.is_prefetched(handle):
                coll.drop_prefetched(handle)
        return output

    def _take(self, dataloader_iter: Iterator[Any]) -> None:
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            return
        batch = batch.to(self._device, non_blocking=True) if hasattr(batch, "to") else batch
        kjts = (
            [v for v in vars(batch).values() if isinstance(v, KeyedJaggedTensor)] if hasattr(batch, "__dict__") else []
        )
        handles = []
        for coll in self._sharded:
            need = set(coll.feature_names())
            found = [k for k in kjts if need <= set(k.keys())]
            if len(found) == 1:
                handles.append((coll, coll.prefetch(found[0])))
        self._held.append((batch, handles))

    def _drop(self) -> None:
        for coll in self._sharded:
            coll.drop_prefetched()


__all__ = ["TrainPipelineSparseDist"]
