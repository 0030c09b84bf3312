"""Reading shardrec checkpoints through Lightning's public extension points (no patched loader).

* :class:`ShardRecCheckpointIO`: the ``CheckpointIO`` plugin :class:`~lightning_shardrec.ShardRecStrategy`
  uses by default, and one a plain Trainer can be given (``Trainer(plugins=[ShardRecCheckpointIO()])``)
  to ``validate``/``test``/``predict`` with ``ckpt_path=`` a sharded checkpoint directory. Files
  go to Lightning's ``TorchCheckpointIO`` unchanged.
* :func:`load_from_checkpoint`: ``Model.load_from_checkpoint`` for every shardrec checkpoint, the
  sharded directory included (Lightning's own loader opens a file, so a directory raises
  ``IsADirectoryError`` there), each large weight streamed into the model.

A ``checkpoint_format="full"`` file whose tables train by the user's own optimizer's rule holds
their optimizer state in the plain layout (where the user's optimizer keeps it), so a Trainer
without the strategy resumes ``fit`` from it. Any other shardrec checkpoint (a sharded
directory, a full file with ``embedding_optimizer=...``) keeps the tables' optimizer state in
the fused part; resuming ``fit`` from it in such a Trainer cannot continue the same training:
:class:`ShardRecCheckpointIO` refuses it by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule
from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml
from typing_extensions import override

from lightning_shardrec.checkpoint import is_sharded_checkpoint, read_full
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.lightning.pl_compat import load_state

PLAIN_RESUME = (
    "checkpoint '{path}' was written by ShardRecStrategy: its embedding tables train in a fused optimizer whose "
    "state is not in the dense optimizer's, so a Trainer without the strategy cannot resume training from it. "
    "Resume with Trainer(strategy='shardrec') on any number of devices (devices=1 too); for the weights alone, "
    "lightning_shardrec.lightning.load_from_checkpoint(Model, path), or "
    "lightning_shardrec.checkpoint.convert_to_full(path, out_file) then Model.load_from_checkpoint(out_file)"
)


def is_shardrec_checkpoint(checkpoint: Any) -> bool:
    """Whether a loaded checkpoint dict was written by ShardRecStrategy with sharded tables."""
    return isinstance(checkpoint, dict) and "shardrec_plan" in checkpoint


def in_plain_layout(checkpoint: Any) -> bool:
    """Whether a shardrec checkpoint holds the tables' optimizer state where a plain run keeps it
    (a full file:
    :meth:`~lightning_shardrec.lightning.checkpoints.checkpointing.ShardedCheckpoints.plain_layout`)."""
    fused = checkpoint.get("shardrec_fused_optimizer") if isinstance(checkpoint, dict) else None
    return isinstance(fused, dict) and fused.get("layout") == "plain"


#: Lightning 2.6's ``TorchCheckpointIO.load_checkpoint`` takes ``weights_only``; 2.5's does not
_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(TorchCheckpointIO.load_checkpoint).parameters


def _torch_load(path: Any, map_location: Any, weights_only: bool | None) -> Any:
    """``TorchCheckpointIO.load_checkpoint`` as Lightning 2.6 does it (local or ``fsspec`` path), on 2.5."""
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    with fs.open(path, "rb") as f:
        return torch.load(f, map_location=map_location, weights_only=weights_only)


def _sharded_dir(path: Any) -> bool:
    return isinstance(path, (str, Path)) and "://" not in str(path) and is_sharded_checkpoint(path)


class _RefusedOptimizerStates(list):  # type: ignore[type-arg]
    """The dense optimizer states of a shardrec checkpoint read by a Trainer without the strategy:
    restoring them (the only reader: ``fit`` resuming) raises :class:`CheckpointError` naming what to do."""

    def __init__(self, states: list[Any], path: Any) -> None:
        super().__init__(states)
        self.path = path

    def __iter__(self) -> Iterator[Any]:
        raise CheckpointError(PLAIN_RESUME.format(path=self.path))


def resumable(checkpoint: Any) -> Any:
    """``checkpoint`` with its optimizer states as read (the strategy's own resume: not refused)."""
    states = checkpoint.get("optimizer_states") if isinstance(checkpoint, dict) else None
    if isinstance(states, _RefusedOptimizerStates):
        checkpoint["optimizer_states"] = states[:]  # a plain list (slicing does not iterate)
    return checkpoint


class ShardRecCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that also reads sharded checkpoint directories (weights streamed).

    Args:
        refuse_resume: a shardrec checkpoint's optimizer states raise :class:`CheckpointError` when restored
            (a Trainer without the strategy resuming ``fit``); the strategy's own instance passes False.
    """

    def __init__(self, refuse_resume: bool = True) -> None:
        super().__init__()
        self.refuse_resume = refuse_resume

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if _sharded_dir(path):  # a full checkpoint, large weights read when copied (read_full, lazy)
            checkpoint = read_full(path, lazy=True)
        elif _TAKES_WEIGHTS_ONLY:
            checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        else:  # Lightning 2.5: its loader has no weights_only (and reads with weights_only=False)
            checkpoint = _torch_load(path, map_location, weights_only)
        states = checkpoint.get("optimizer_states") if isinstance(checkpoint, dict) else None
        refused = is_shardrec_checkpoint(checkpoint) and not in_plain_layout(checkpoint)
        if self.refuse_resume and refused and isinstance(states, list):
            checkpoint["optimizer_states"] = _RefusedOptimizerStates(states, path)
        return checkpoint


def load_from_checkpoint(
    cls: type[LightningModule],
    checkpoint_path: Any,
    map_location: Any = None,
    hparams_file: str | Path | None = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for any shardrec checkpoint, in a process without a Trainer.

    A file (``checkpoint_format="full"``, or a plain Trainer's) goes to Lightning's
    ``cls.load_from_checkpoint`` unchanged. A sharded checkpoint directory (the default format)
    is read as the full checkpoint :func:`~lightning_shardrec.checkpoint.convert_to_full` would write
    (unsharded keys, no process group, the fused optimizer state not read): each weight of at
    least 1 MiB is a stand-in that ``load_state_dict`` copies from the files into the model one
    saved piece at a time (peak: the model and one piece, not the model twice). The module is
    built as Lightning builds it: saved hyperparameters (``hparams_file`` and ``kwargs`` win),
    ``on_load_checkpoint``, ``load_state_dict(strict=...)``; then moved to ``map_location`` when
    that is a device.
    """
    if not _sharded_dir(checkpoint_path):
        return cls.load_from_checkpoint(
            checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs
        )
    checkpoint = read_full(checkpoint_path, lazy=True)
    if hparams_file is not None:
        suffix = Path(hparams_file).suffix.lower()
        if suffix not in (".csv", ".yml", ".yaml"):
            raise ValueError(f"hparams_file must end in .csv, .yml or .yaml, got '{hparams_file}'")
        read = load_hparams_from_tags_csv if suffix == ".csv" else load_hparams_from_yaml
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = read(str(hparams_file))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    model = load_state(cls, checkpoint, strict, **kwargs)
    if isinstance(map_location, (str, torch.device)):
        model = model.to(map_location)
    return model


__all__ = ["PLAIN_RESUME", "ShardRecCheckpointIO", "is_shardrec_checkpoint", "load_from_checkpoint", "resumable"]
