"""shardrec checkpoints read by code that does not know them: ``Model.load_from_checkpoint`` and a plain Trainer.

Lightning reads checkpoints through one function (``pl_load``); :func:`install` (run when
``lightning_shardrec.lightning`` is imported) puts a wrapper in its two call sites:

* ``Model.load_from_checkpoint(path)`` on a sharded checkpoint directory (the default
  format) reads it as a full checkpoint (tables gathered, unsharded keys), as
  :func:`~lightning_shardrec.checkpoint.convert_to_full` would write it, except that each
  large weight is a :class:`~lightning_shardrec.checkpoint.stored_tensor.StoredTensor` read
  when used: ``load_state_dict`` copies it from the files into the model piece by piece
  (peak: the model and one saved piece, not the model twice);
* a Trainer without ``strategy="shardrec"`` given a shardrec checkpoint (directory or
  ``checkpoint_format="full"`` file) gets its weights (``validate``/``test``/``predict``
  with ``ckpt_path`` work), but resuming ``fit`` from it raises
  :class:`~lightning_shardrec.errors.CheckpointError` naming what to do: the saved dense
  optimizer lacks the fused tables, whose state lives in the checkpoint's fused part.

Every other file goes to Lightning's loader unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_shardrec.checkpoint import is_sharded_checkpoint, read_full
from lightning_shardrec.errors import CheckpointError

_own = 0  # > 0 while ShardRecStrategy itself loads a checkpoint


@contextmanager
def own_load() -> Iterator[None]:
    """ShardRecStrategy's own loads: files pass through untouched."""
    global _own
    _own += 1
    try:
        yield
    finally:
        _own -= 1


def _resume_refused(path: Any) -> str:
    return (
        f"checkpoint '{path}' was written by ShardRecStrategy: its embedding tables train in a fused optimizer whose "
        "state is not in the dense optimizer's, so a Trainer without the strategy cannot resume training from it. "
        "Resume with Trainer(strategy='shardrec') on any number of devices (devices=1 too); for the weights alone, "
        "Model.load_from_checkpoint(path) or lightning_shardrec.checkpoint.convert_to_full(path, out_file) "
        "then load the file into the plain model"
    )


class _RefusedOptimizerStates(list):  # type: ignore[type-arg]
    """The dense optimizer states of a shardrec checkpoint: reading them to resume raises (see the module)."""

    def __init__(self, states: list[Any], path: Any) -> None:
        super().__init__(states)
        self.path = path

    def __iter__(self) -> Iterator[Any]:
        raise CheckpointError(_resume_refused(self.path))


def _wrap(load: Callable[..., Any], refuse_resume: bool) -> Callable[..., Any]:
    def shardrec_aware_load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        sharded = isinstance(path_or_url, (str, Path)) and "://" not in str(path_or_url)
        if sharded and is_sharded_checkpoint(path_or_url):
            checkpoint = read_full(path_or_url, lazy=True)  # tables stream into the model as it copies them
        else:
            checkpoint = load(path_or_url, *args, **kwargs)
        if _own or not isinstance(checkpoint, dict) or "shardrec_plan" not in checkpoint:
            return checkpoint
        states = checkpoint.get("optimizer_states")
        if isinstance(states, list) and refuse_resume:
            checkpoint["optimizer_states"] = _RefusedOptimizerStates(states, path_or_url)
        return checkpoint

    shardrec_aware_load.__wrapped__ = load  # type: ignore[attr-defined]
    return shardrec_aware_load


def install() -> None:
    """Wrap Lightning's checkpoint loader where ``load_from_checkpoint`` and ``TorchCheckpointIO`` call it (once)."""
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    for module, refuse_resume in ((saving, False), (torch_io, True)):
        if not hasattr(module.pl_load, "__wrapped__"):
            module.pl_load = _wrap(module.pl_load, refuse_resume)  # type: ignore[attr-defined]
