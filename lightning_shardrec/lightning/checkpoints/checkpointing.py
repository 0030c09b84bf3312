"""Checkpoints of a sharded model, as the Trainer and Fabric strategies write and read them.

Sharded (default): a DCP directory, each rank writing its shards, swapped into place
atomically once every rank has finished. Full (``checkpoint_format="full"``): one file
with gathered tables, written beside the target and renamed in. Both hold the fused
optimizer state, are checked against the model before anything is loaded, never run
pickled code, and load into any world size and plan.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from lightning_shardrec.checkpoint import (
    FullGather,
    StreamedFile,
    agree_failures,
    dense_problems,
    discard,
    gather_full_state,
    load_full_state,
    load_sharded,
    merge_plain_optimizer_states,
    plain_layout_possible,
    recover_interrupted,
    replicated_keys,
    save_sharded,
    save_streamed,
    split_plain_optimizer_states,
)
from lightning_shardrec.checkpoint.mapped_file import MappedFile, load_mapped, mappable
from lightning_shardrec.checkpoint.streamed_file import Stored
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.lightning.checkpoints.checkpoint_io import ShardRecCheckpointIO
from lightning_shardrec.lightning.parameters.tables import ShardedTables

log = logging.getLogger(__name__)
FUSED_KEY = "shardrec_fused_optimizer"


class Ranks(Protocol):
    """What checkpointing needs of a strategy (Lightning's and Fabric's ``DDPStrategy`` both have it)."""

    @property
    def global_rank(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...


class ShardedCheckpoints:
    """The checkpoints of one model's :class:`~lightning_shardrec.lightning.parameters.tables.ShardedTables`.

    A plain object both strategies hold: what a checkpoint of the tables holds beside the
    caller's state (the plan, the fused optimizer's param group), the sharded (DCP) and full
    (streamed) writes, the reads of either, and the restore of the weights and the optimizer
    states, checked before anything is copied. ``ranks`` gives the rank, ``broadcast`` and
    ``barrier`` (a Lightning or Fabric strategy, or anything with those three).
    """

    def __init__(self, tables: ShardedTables, ranks: Ranks) -> None:
        self.tables = tables
        self.ranks = ranks
        self.loaded_in_place = False
        #: per optimizer, per param group: its parameters before the tables left it, tables as keys (set in setup)
        self.groups_before: list[list[list[torch.nn.Parameter | str]]] | None = None
        #: the plain checkpoint file being restored, when it was memory-mapped (see ``read_file``)
        self.mapped: MappedFile | None = None

    @property
    def full(self) -> bool:
        return self.tables.options.checkpoint_format == "full"

    def add_meta(self, checkpoint: dict[str, Any]) -> None:
        """The plan and the fused optimizer's param group, into ``checkpoint`` (room for the full states)."""
        fused = self.tables.fused_optimizer
        assert fused is not None
        group = {k: v for k, v in fused.param_groups[0].items() if k != "params"}
        plan = self.tables.plan
        checkpoint["shardrec_plan"] = plan.to_json() if plan is not None else None
        checkpoint[FUSED_KEY] = {"states": {}, "param_group": group} if self.full else {"param_group": group}

    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        weights_key: str = "state_dict",
        writer: Callable[[dict[str, Any]], None] | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Collective: ``checkpoint`` (the dense weights under ``weights_key``) with the tables, the plan and
        the fused state. Sharded: a DCP directory; full: one file streamed in bands of rows, or (``writer``:
        a custom or remote writer) gathered on rank 0 and handed to ``writer``; in the plain layout where it
        can be (:meth:`plain_layout`, ``optimizers``: the user's, as they are now)."""
        self.add_meta(checkpoint)
        if not self.full:
            return self.save_sharded(filepath, checkpoint.pop(weights_key), checkpoint)
        if writer is None:
            return self.save_full(checkpoint, filepath, weights_key, optimizers)
        self.gather_into(checkpoint, weights_key)
        return writer(self.plain_layout(checkpoint, optimizers))

    def load(
        self,
        checkpoint_path: Any,
        dense: Callable[[], dict[str, torch.Tensor]],
        weights_only: bool,
        read: Callable[[], dict[str, Any]],
        may_map: bool,
    ) -> tuple[dict[str, Any], bool]:
        """Collective: a checkpoint directory read into the shards and ``dense()`` in place (its meta, True), or
        a file read (see :meth:`read_file`; its contents, False)."""
        self.mapped = None  # set by read_file when it maps the file
        path = self.recover(checkpoint_path)
        if self.tables.sharded and path.is_dir():
            return self.load_sharded(path, dense()), True
        return self.read_file(checkpoint_path, weights_only, read, may_map), False

    def save_sharded(self, path: Any, dense: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Collective: a DCP directory at ``path`` (atomic; raises on every rank), ``meta`` from rank 0."""
        path = Path(self.ranks.broadcast(str(path)))
        save_sharded(path, self.tables.sharded, dense, meta, self.ranks.global_rank)

    def gather_into(self, checkpoint: dict[str, Any], weights_key: str = "state_dict") -> None:
        """Collective: the full tables and their fused states into ``checkpoint`` on rank 0 (a custom writer)."""
        weights, states = gather_full_state(self.tables.sharded, dst=0)
        checkpoint[weights_key].update(weights)
        checkpoint[FUSED_KEY]["states"] = states

    def save_full(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        weights_key: str = "state_dict",
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Collective: rank 0 writes one file beside ``filepath``, in bands of rows, and renames it into place.

        Every full tensor's shape is gathered first and its room reserved in the file with the
        checkpoint pickled around stand-ins; then each tensor's rows are gathered on rank 0 in
        bands of at most ``PIECE_BYTES`` and written into their place
        (:class:`~lightning_shardrec.checkpoint.full_gather.FullGather`,
        :func:`~lightning_shardrec.checkpoint.save_streamed`), so rank 0 holds its share and one
        band. A failure raises on every rank.
        """
        gather = FullGather(self.tables.sharded, dst=0)
        bands = gather.bands()
        error: BaseException | None = None
        if self.ranks.global_rank == 0:
            stored: list[Stored] = []
            try:
                save_streamed(
                    Path(filepath),
                    lambda stream: self.plain_layout(
                        _reserve(stream, gather, checkpoint, stored, weights_key), optimizers
                    ),
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

    def plain_layout(self, checkpoint: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
        """A full checkpoint in the plain layout: the tables' optimizer state moved into ``optimizer_states``
        where a run without the strategy keeps it (``optimizers``: the user's, as ``configure_optimizers`` built
        them), so ``Trainer(devices=1).fit(model, ckpt_path=file)`` without the strategy resumes from it.

        Only when the tables train by the user's own optimizer's rule (no ``embedding_optimizer``, no
        sharders' rule: the state names are torch's) and no state is per row; otherwise the states stay
        in the strategy's own entry (the strategy resumes either layout).
        """
        fused, before, options = checkpoint[FUSED_KEY], self.groups_before, self.tables.options
        own_rule = options.embedding_optimizer is None and not options.sharders
        if not (own_rule and before is not None and optimizers and "optimizer_states" in checkpoint):
            return checkpoint
        states = fused["states"]
        if not plain_layout_possible(before, states):
            return checkpoint
        now = [[list(g["params"]) for g in opt.param_groups] for opt in optimizers]
        replicated = replicated_keys(self.tables.sharded)
        checkpoint["optimizer_states"], positions = merge_plain_optimizer_states(
            checkpoint["optimizer_states"], states, before, now, replicated
        )
        # the tables' places there: lightning_shardrec.checkpoint.plain_table_states reads them back
        fused.update(states={}, layout="plain", positions={k: list(v) for k, v in positions.items()})
        return checkpoint

    def remove(self, filepath: Any) -> None:
        """Rank 0 deletes a local checkpoint file, link or directory, renaming it aside first (never half-deleted)."""
        if self.ranks.global_rank == 0:
            discard(Path(filepath))

    def recover(self, checkpoint_path: Any) -> Path:
        """Collective: rank 0's path, after rank 0 finished a save that died between its two renames."""
        path = Path(self.ranks.broadcast(str(checkpoint_path)))
        if not remote(checkpoint_path):
            if self.ranks.global_rank == 0:
                try:
                    recover_interrupted(path)
                except OSError as e:
                    log.warning("could not restore checkpoint %s from a half-finished save: %s", path, e)
            self.ranks.barrier("shardrec_load_checkpoint")
        return path

    def load_sharded(self, path: Path, dense: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Collective: the directory's tables, fused states and ``dense`` entries in place; its meta."""
        meta = load_sharded(path, self.tables.sharded, dense, self.ranks.global_rank)
        self.loaded_in_place = True
        return meta

    def read_file(
        self, checkpoint_path: Any, weights_only: bool, read: Callable[[], dict[str, Any]], may_map: bool
    ) -> dict[str, Any]:
        """A checkpoint file (``read()``: the caller's reader, ``weights_only`` honoured), errors made clear.

        With ``may_map`` (the default ``CheckpointIO``), a local zip-format file is memory-mapped instead of read
        whole on every rank: each rank copies its rows of each table into its shards and releases
        the pages (:mod:`~lightning_shardrec.checkpoint.mapped_file`); everything else is copied out
        of the file.
        """
        self.mapped = None
        try:
            if self.tables.sharded and may_map and mappable(checkpoint_path):
                checkpoint, self.mapped = load_mapped(checkpoint_path, weights_only)
                streamed = ("state_dict", "optimizer_states", FUSED_KEY)  # copied out, or sliced, when restored
                return {k: v if k in streamed else self.mapped.owned(v) for k, v in checkpoint.items()}
            return read()
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint '{checkpoint_path}' holds objects other than tensors and plain containers; refusing to "
                f"load it (it could run code). Pass weights_only=False only for a file you trust. {e}"
            ) from None
        except (RuntimeError, EOFError) as e:
            raise CheckpointError(f"checkpoint '{checkpoint_path}' is truncated or corrupt: {e}") from None

    def load_weights(
        self, state: Mapping[str, Any], module: torch.nn.Module, dense: dict[str, Any], strict: bool
    ) -> None:
        """A full state dict into the shards and ``module``'s dense rest; everything is checked (on every rank)
        before anything is copied. Nothing to do after :meth:`load_sharded` (loaded in place)."""
        if self.loaded_in_place:
            self.loaded_in_place = False
            return
        prefixes = tuple(f"{p}." for p in self.tables.sharded)
        rest = {k: v for k, v in state.items() if not k.startswith(prefixes)}
        tables = {k: v for k, v in state.items() if k.startswith(prefixes)}
        copy = None if self.mapped is None else self.mapped.copy
        load_full_state(self.tables.sharded, tables, also=dense_problems(dense, rest, strict), copy=copy)
        module.load_state_dict(rest, strict=False)

    def load_optimizers(
        self,
        checkpoint: Mapping[str, Any],
        optimizers: list[torch.optim.Optimizer],
        load_dense: Callable[[Mapping[str, Any]], None],
    ) -> None:
        """The fused state and param group from ``checkpoint``; ``load_dense`` loads the dense optimizers' states
        (from ``checkpoint["optimizer_states"]``, split from the tables' when the file was written without the
        strategy)."""
        mapped, self.mapped = self.mapped, None
        copy = None if mapped is None else mapped.copy
        fused = checkpoint.get(FUSED_KEY)
        sharded = self.tables.sharded
        plain = fused is None or fused.get("layout") == "plain"
        if plain and sharded and self.groups_before is not None and "optimizer_states" in checkpoint:
            # written without the strategy, or full in the plain layout: the tables' state sits in the user's
            # optimizer state
            now = [[list(g["params"]) for g in opt.param_groups] for opt in optimizers]
            dense, states = split_plain_optimizer_states(
                checkpoint["optimizer_states"], self.groups_before, now, replicated_keys(sharded)
            )
            dense = dense if mapped is None else mapped.owned(dense)  # kept by the optimizers: out of the file
            load_dense({**checkpoint, "optimizer_states": dense})
            load_full_state(sharded, states=states, copy=copy)
            if fused is not None and self.tables.fused_optimizer is not None:
                self.tables.fused_optimizer.param_groups[0].update(fused["param_group"])
            return
        if mapped is not None and "optimizer_states" in checkpoint:
            checkpoint = {**checkpoint, "optimizer_states": mapped.owned(checkpoint["optimizer_states"])}
        load_dense(checkpoint)
        if fused is not None and sharded:
            self.load_fused(fused, copy)

    def load_fused(self, fused: Mapping[str, Any], copy: Any = None) -> None:
        """The fused optimizer's saved param group (and, from a full file, its states)."""
        if "states" in fused:
            load_full_state(self.tables.sharded, states=fused["states"], copy=copy)
        if self.tables.fused_optimizer is not None:
            self.tables.fused_optimizer.param_groups[0].update(fused["param_group"])


def _reserve(
    stream: StreamedFile, gather: FullGather, checkpoint: dict[str, Any], stored: list[Stored], weights_key: str
) -> dict[str, Any]:
    """Room in ``stream`` for every gathered tensor (stand-ins into ``stored``, in order); the checkpoint to pickle."""
    states = checkpoint[FUSED_KEY]["states"]
    for key, state, shape in gather.tensors:
        stored.append(stream.reserve(shape))
        if state is None:
            checkpoint[weights_key][key] = stored[-1]
        else:
            states.setdefault(key, {})[state] = stored[-1]
    checkpoint[weights_key].update({k: stream.put(t) for k, t in gather.mappings.items()})
    return checkpoint


def _fill(stream: StreamedFile, bands: Iterator[tuple[int, int, torch.Tensor]], stored: list[Stored]) -> None:
    """Write each band of rows into its reserved tensor as it arrives, dropping it before the next."""
    for index, first, rows in bands:
        stream.fill(stored[index], first, rows)
        del rows


def default_io(io: CheckpointIO) -> bool:
    """The strategy's own plugin, or Lightning's plain one: local files are written and read in pieces."""
    return type(io) is TorchCheckpointIO or isinstance(io, ShardRecCheckpointIO)


def remote(path: Any) -> bool:
    return "://" in str(path)
