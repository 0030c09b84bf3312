"""Checkpoints of a sharded model, as the Lightning strategy writes and reads them.

Sharded (default): a DCP directory, each rank writing its shards, swapped into place
atomically once every rank has finished. Full (``checkpoint_format="full"``): one file
with gathered tables, written beside the target and renamed in. Both hold the fused
optimizer state, are checked against the model before anything is loaded, never run
pickled code, and load into any world size and plan.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from inspect import signature
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_shardrec.checkpoint import (
    FullGather,
    StreamedFile,
    agree_failures,
    dense_problems,
    discard,
    gather_full_state,
    load_full_state,
    load_sharded,
    recover_interrupted,
    replicated_keys,
    save_sharded,
    save_streamed,
    split_plain_optimizer_states,
)
from lightning_shardrec.checkpoint.mapped_file import MappedFile, load_mapped, mappable
from lightning_shardrec.checkpoint.streamed_file import Stored
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.lightning.checkpoint_io import ShardRecCheckpointIO, resumable
from lightning_shardrec.lightning.options import ShardRecOptions
from lightning_shardrec.lightning.pipeline import TrainPipeline
from lightning_shardrec.optim import FusedOptimizer
from lightning_shardrec.planner import ShardingPlan

log = logging.getLogger(__name__)
_FUSED_KEY = "shardrec_fused_optimizer"


class ShardedCheckpointing(DDPStrategy):
    """The checkpoint half of :class:`~lightning_shardrec.lightning.ShardRecStrategy`."""

    sharded: dict[str, ShardedCollection]
    plan: ShardingPlan | None
    fused_optimizer: FusedOptimizer | None
    pipeline: TrainPipeline | None
    options: ShardRecOptions
    _loaded_in_place: bool
    #: per optimizer, per param group: its parameters before the tables left it, tables as keys (set in setup)
    _groups_before: list[list[list[torch.nn.Parameter | str]]] | None = None
    #: the plain checkpoint file being restored, when it was memory-mapped (see ``_load_file``)
    _mapped: MappedFile | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Lightning's public seam for checkpoint I/O; a plugin given to the Trainer replaces it
        self.checkpoint_io = ShardRecCheckpointIO(refuse_resume=False)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # tables are restored into their shards, so the sharded model must exist

    def _dense_state(self) -> dict[str, torch.Tensor]:
        prefixes = tuple(f"{p}." for p in self.sharded)
        guard = getattr(self, "guard", None)
        with nullcontext() if guard is None else guard.allow_state_dict():
            state = self.lightning_module.state_dict()  # type: ignore[union-attr]
        return {k: v for k, v in state.items() if not k.startswith(prefixes)}

    def full_state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """Collective: the unsharded model's state dict (tables gathered) on global rank ``dst``.

        ``None``: on every rank (tests, small models). Tables travel in bands by tensor collectives
        (:class:`~lightning_shardrec.distributed.comm.band_gather.BandGather`): rank ``dst`` holds the
        result and one band, the other ranks their shards only, and get ``{}``.
        """
        if not self.sharded:
            return self.lightning_module.state_dict()  # type: ignore[union-attr]
        weights, _ = gather_full_state(self.sharded, dst)
        if dst is not None and self.global_rank != dst:
            return {}
        return {**self._dense_state(), **weights}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.sharded:
            return super().lightning_module_state_dict()
        # tables go to DCP (sharded) or are gathered one at a time into the file (full) in save_checkpoint
        return self._dense_state()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self.sharded or "state_dict" not in checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        assert self.fused_optimizer is not None
        if self.pipeline is not None:
            self.pipeline.patch_loader_states(checkpoint)
        group = {k: v for k, v in self.fused_optimizer.param_groups[0].items() if k != "params"}
        checkpoint["shardrec_plan"] = self.plan.to_json() if self.plan is not None else None
        if self.options.checkpoint_format == "full":
            checkpoint[_FUSED_KEY] = {"states": {}, "param_group": group}
            return self._save_full(checkpoint, filepath, storage_options)
        checkpoint[_FUSED_KEY] = {"param_group": group}
        path = Path(self.broadcast(str(filepath)))
        dense = checkpoint.pop("state_dict")
        save_sharded(path, self.sharded, dense, checkpoint, self.global_rank)  # atomic; raises on every rank

    def _save_full(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """Collective: rank 0 writes one file beside ``filepath``, in bands of rows, and renames it into place.

        Every full tensor's shape is gathered first and its room reserved in the file with the
        checkpoint pickled around stand-ins; then each tensor's rows are gathered on rank 0 in
        bands of at most ``PIECE_BYTES`` and written into their place
        (:class:`~lightning_shardrec.checkpoint.full_gather.FullGather`,
        :func:`~lightning_shardrec.checkpoint.save_streamed`), so rank 0 holds its share and one
        band. A failure raises on every rank. A custom or remote writer takes the whole
        checkpoint at once: rank 0 then holds every table.
        """
        if not _default_io(self.checkpoint_io) or storage_options is not None or _remote(filepath):
            weights, states = gather_full_state(self.sharded, dst=0)
            checkpoint["state_dict"].update(weights)
            checkpoint[_FUSED_KEY]["states"] = states
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        gather = FullGather(self.sharded, dst=0)
        bands = gather.bands()
        error: BaseException | None = None
        if self.is_global_zero:
            stored: list[Stored] = []
            try:
                save_streamed(
                    Path(filepath),
                    lambda stream: _reserve(stream, gather, checkpoint, stored),
                    lambda stream: _fill(stream, bands, stored),
                )
            except Exception as e:  # agreed on below, so no rank waits in a barrier for rank 0
                error = e
        for _ in bands:  # the other ranks send their rows (rank 0: what a failed write left)
            pass
        failures = agree_failures(error)
        if failures:
            failed = "\n  ".join(failures)
            raise CheckpointError(
                f"saving checkpoint '{filepath}' failed; what was there before is untouched:\n  {failed}"
            ) from error
        return None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 deletes a checkpoint file, link or directory, renaming it aside first (never half-deleted)."""
        if _remote(filepath):
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            discard(Path(filepath))
        return None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._mapped = None  # set by _load_file when it maps the file
        path = Path(self.broadcast(str(checkpoint_path)))
        if not _remote(checkpoint_path):
            if self.is_global_zero:
                try:
                    recover_interrupted(path)  # a save that died between its two renames
                except OSError as e:
                    log.warning("could not restore checkpoint %s from a half-finished save: %s", path, e)
            self.barrier("shardrec_load_checkpoint")
        if not (self.sharded and path.is_dir()):
            return self._load_file(checkpoint_path, True if weights_only is None else weights_only)
        meta = load_sharded(path, self.sharded, self._dense_state(), self.global_rank)
        meta["state_dict"] = {}  # already loaded in place
        self._loaded_in_place = True
        return meta

    def _load_file(self, checkpoint_path: Any, weights_only: bool) -> dict[str, Any]:
        """Lightning's loader (``weights_only=True`` unless the caller trusts the file), errors made clear.

        A local zip-format file under the default ``CheckpointIO`` is memory-mapped instead of read
        whole on every rank: each rank copies its rows of each table into its shards and releases
        the pages (:mod:`~lightning_shardrec.checkpoint.mapped_file`); everything else Lightning
        keeps (dense optimizer state, callbacks' state) is copied out of the file.
        """
        try:
            if self.sharded and _default_io(self.checkpoint_io) and mappable(checkpoint_path):
                checkpoint, self._mapped = load_mapped(checkpoint_path, weights_only)
                streamed = ("state_dict", "optimizer_states", _FUSED_KEY)  # copied out, or sliced, when restored
                return {k: v if k in streamed else self._mapped.owned(v) for k, v in checkpoint.items()}
            if isinstance(self.checkpoint_io, ShardRecCheckpointIO):  # takes weights_only on Lightning 2.5 too
                return resumable(self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only))
            return resumable(super().load_checkpoint(checkpoint_path, **_weights_only(weights_only)))
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint '{checkpoint_path}' holds objects other than tensors and plain containers; refusing to "
                f"load it (it could run code). Pass weights_only=False only for a file you trust. {e}"
            ) from None
        except (RuntimeError, EOFError) as e:
            raise CheckpointError(f"checkpoint '{checkpoint_path}' is truncated or corrupt: {e}") from None

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.sharded:
            return super().load_model_state_dict(checkpoint, strict)
        if self._loaded_in_place:
            self._loaded_in_place = False
            return None
        prefixes = tuple(f"{p}." for p in self.sharded)
        state = checkpoint["state_dict"]
        rest = {k: v for k, v in state.items() if not k.startswith(prefixes)}
        tables = {k: v for k, v in state.items() if k.startswith(prefixes)}
        # every table and dense tensor is checked (on every rank) before anything is copied
        copy = None if self._mapped is None else self._mapped.copy
        load_full_state(self.sharded, tables, also=dense_problems(self._dense_state(), rest, strict), copy=copy)
        self.lightning_module.load_state_dict(rest, strict=False)  # type: ignore[union-attr]
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        mapped, self._mapped = self._mapped, None
        copy = None if mapped is None else mapped.copy
        fused = checkpoint.get(_FUSED_KEY)
        if fused is None and self.sharded and self._groups_before is not None and "optimizer_states" in checkpoint:
            # written without the strategy: the tables' state sits in the user's optimizer state
            now = [[list(g["params"]) for g in opt.param_groups] for opt in self.optimizers]
            dense, states = split_plain_optimizer_states(
                checkpoint["optimizer_states"],
                self._groups_before,
                now,
                replicated_keys(self.sharded),
            )
            dense = dense if mapped is None else mapped.owned(dense)  # kept by the optimizers: out of the file
            super().load_optimizer_state_dict({**checkpoint, "optimizer_states": dense})
            load_full_state(self.sharded, states=states, copy=copy)
            return
        if mapped is not None and "optimizer_states" in checkpoint:
            checkpoint = {**checkpoint, "optimizer_states": mapped.owned(checkpoint["optimizer_states"])}
        super().load_optimizer_state_dict(checkpoint)
        if fused is not None and self.sharded:
            if "states" in fused:
                load_full_state(self.sharded, states=fused["states"], copy=copy)
            if self.fused_optimizer is not None:
                self.fused_optimizer.param_groups[0].update(fused["param_group"])


def _reserve(
    stream: StreamedFile, gather: FullGather, checkpoint: dict[str, Any], stored: list[Stored]
) -> dict[str, Any]:
    """Room in ``stream`` for every gathered tensor (stand-ins into ``stored``, in order); the checkpoint to pickle."""
    states = checkpoint[_FUSED_KEY]["states"]
    for key, state, shape in gather.tensors:
        stored.append(stream.reserve(shape))
        if state is None:
            checkpoint["state_dict"][key] = stored[-1]
        else:
            states.setdefault(key, {})[state] = stored[-1]
    checkpoint["state_dict"].update({k: stream.put(t) for k, t in gather.mappings.items()})
    return checkpoint


def _fill(stream: StreamedFile, bands: Iterator[tuple[int, int, torch.Tensor]], stored: list[Stored]) -> None:
    """Write each band of rows into its reserved tensor as it arrives, dropping it before the next."""
    for index, first, rows in bands:
        stream.fill(stored[index], first, rows)
        del rows


def _weights_only(weights_only: bool) -> dict[str, bool]:
    """``weights_only`` for ``Strategy.load_checkpoint`` where it takes one (Lightning 2.6; 2.5's does not)."""
    return {"weights_only": weights_only} if "weights_only" in signature(DDPStrategy.load_checkpoint).parameters else {}


def _default_io(io: CheckpointIO) -> bool:
    """The strategy's own plugin, or Lightning's plain one: local files are written and read in pieces."""
    return type(io) is TorchCheckpointIO or isinstance(io, ShardRecCheckpointIO)


def _remote(path: Any) -> bool:
    return "://" in str(path)
