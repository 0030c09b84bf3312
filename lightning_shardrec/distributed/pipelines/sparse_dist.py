"""``TrainPipelineSparseDist`` at TorchRec's path: a hand-written loop with batch ``i + 1``'s input
distribution behind batch ``i``'s compute (the overlap of ``ShardRecStrategy(pipeline=True)``).

Per ``progress(dataloader_iter)`` call::

    take batch i+1 from the iterator, move it to the device, start its id all-to-alls (prefetch)
    zero_grad; (losses, output) = model(batch i)   the collections find batch i's prefetched ids
    issue batch i+1's id all-to-alls; sum(losses).backward(); optimizer.step()
    return output

The first call takes two batches; once the iterator is exhausted the calls run the
batches still held, then raise ``StopIteration``. A call with another iterator (the next
epoch's ``iter(loader)``) starts over from it, as TorchRec's. In ``model.eval()`` mode only the
forward runs; :class:`EvalPipelineSparseDist` never trains. ``detach()`` hands the model back
for other use (the batches in flight stay, ``progress`` resumes them); ``attach(model)`` or the
next ``progress`` takes it back. Every rank must call it the same number of times (as TorchRec's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec.distributed.comm.groups import new_group_like
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
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
        self._iter: Iterator[Any] | None = None
        self._exhausted = False
        self._attached = True
        self._trains = True

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train one batch and return the model's ``output``; ``StopIteration`` when none is left."""
        if not self._attached:
            self.attach()
        if not self._held:  # the first call, or the first of a new iterator (the next epoch)
            self._take(dataloader_iter)
        if not self._held:
            self._drop()
            raise StopIteration
        self._take(dataloader_iter)  # batch i + 1: moved and its input distribution started
        batch, handles = self._held.pop(0)
        training = self._trains and self._model.training
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

    def detach(self) -> nn.Module:
        """The model, for use outside the pipeline; the batches in flight stay for the next ``progress``."""
        self._attached = False
        return self._model

    def attach(self, model: nn.Module | None = None, sparse_dist: bool = True) -> None:
        """Take the model back (``model``: the same one, or the model to pipeline from now on).

        ``sparse_dist`` is TorchRec's flag; prefetched batches keep their input distribution either way.
        """
        del sparse_dist
        if model is not None and model is not self._model:
            if self._held:
                raise UnsupportedFeatureError(
                    f"TrainPipelineSparseDist.attach: {len(self._held)} batch(es) of the previous model are in "
                    "flight; run them (progress until StopIteration) or reset() before attaching another model"
                )
            self._forward = model if self._forward is self._model else self._forward
            self._model = model
            self._sharded = [m for m in model.modules() if isinstance(m, ShardedCollection)]
            if self._sharded and self._sharded[0]._prefetch_env is None:
                env = new_group_like(self._sharded[0].env)  # collective: the prefetch's own group
                for coll in self._sharded:
                    coll.enable_prefetch(env)
        self._attached = True

    def reset(self) -> None:
        """Forget the batches in flight (their input distributions drained) and the iterator."""
        self._held.clear()
        self._drop()
        self._iter, self._exhausted = None, False

    def _take(self, dataloader_iter: Iterator[Any]) -> None:
        if dataloader_iter is not self._iter:  # never next() an exhausted iterator again (it may block)
            self._iter, self._exhausted = dataloader_iter, False
        if self._exhausted:
            return
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            self._exhausted = True
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


class EvalPipelineSparseDist(TrainPipelineSparseDist):
    """TorchRec's ``EvalPipelineSparseDist(model, optimizer, device, apply_jit=False, pipeline_postproc=False)``:
    the same overlap, forward only (no zero_grad, backward or step, whatever ``model.training`` says)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
    ) -> None:
        super().__init__(model, optimizer, device, apply_jit=apply_jit, pipeline_postproc=pipeline_postproc)
        self._trains = False


__all__ = ["EvalPipelineSparseDist", "TrainPipelineSparseDist"]
