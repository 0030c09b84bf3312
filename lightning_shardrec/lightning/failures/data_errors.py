"""A bad id in a training batch: say where it is (batch key, step) and how to get past it.

``IdOutOfRangeError`` comes from deep inside a collection and names the feature and table. The
strategy adds what only the loop knows: the training step and batch index, and the place(s) in
the user's batch that hold the id (``batch['item_ids']``, ``batch[2]``, ``batch.sparse['item']``),
and says how to get past it. Resuming from the last checkpoint as it is would replay the same
batch (the checkpoint records the loader's position before it), so the advice is the data's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.errors import IdOutOfRangeError
from lightning_shardrec.sparse import KeyedJaggedTensor

DATA_ADVICE = (
    "This is a data error: fix the ids (each within its table's range) or skip such batches (filter or remap "
    "them in the Dataset or collate_fn, or give the table enough rows); restarting from a checkpoint without "
    "that would replay the same batch"
)


def _tensors(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Tensor]]:
    """``(path, integer tensor)`` for every integer tensor in ``obj`` (dicts, sequences, dataclasses, KJTs)."""
    if depth > 4:
        return
    if isinstance(obj, Tensor):
        if not obj.is_floating_point() and not obj.is_complex() and obj.dtype != torch.bool:
            yield path, obj
    elif isinstance(obj, KeyedJaggedTensor):
        for key in obj.keys():  # noqa: SIM118 (a KJT is not a Mapping)
            yield f"{path}[{key!r}]", obj[key].values()
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}[{key!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name), f"{path}.{field.name}", depth + 1)


def where_in_batch(batch: Any, value: int) -> list[str]:
    """The places in ``batch`` whose integer tensors hold ``value``."""
    return [path for path, t in _tensors(batch, "batch") if t.numel() and bool((t == value).any())]


def explain_bad_id(err: IdOutOfRangeError, batch: Any, step: int, batch_idx: int) -> IdOutOfRangeError:
    """``err`` with the step, the batch index and where the id is in ``batch``, and the data advice (in place)."""
    places = where_in_batch(batch, err.value)
    found = f"; the id is in {', '.join(places)}" if places else ""
    err.args = (f"{err.args[0]}, at training step {step} (batch_idx {batch_idx}){found}. {DATA_ADVICE}",)
    return err


__all__ = ["DATA_ADVICE", "explain_bad_id", "where_in_batch"]
