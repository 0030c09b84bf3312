"""Full (unsharded) checkpoints of sharded collections: gather on save, slice on load.

A full state dict uses the unsharded module's keys (``<path>.embedding_bags.<table>.weight``,
``<path>.embeddings.<table>.weight``),
so it loads into the plain model (``LightningModule.load_from_checkpoint``, inference)
and into a sharded model of *any* world size or plan: resharding is slicing. Fused
optimizer state travels the same way, keyed by the weight's name. A dynamic table's
id mapping is gathered into, and sliced from, the unsharded module's global tensors
(:mod:`.dynamic_state`).

Saving gathers the tables on rank 0 only, one table at a time, in host memory
(:func:`iter_full_state` with ``dst=0``); a writer that writes each table as it arrives
(:mod:`.streamed_file`) holds one table at a time, so this suits tables each of which fits
in rank 0's host memory beside its share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.checkpoint.dynamic_state import (
    DynamicLayout,
    assemble,
    dynamic_configs,
    dynamic_problems,
    local_mappers,
    mapper_chunks,
    mapper_copies,
    mapper_prefix,
)
from lightning_shardrec.checkpoint.validate import pooled
from lightning_shardrec.distributed.collection import ShardedCollection
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.modules.dynamic.layout import BUFFERS

Shards = list[tuple[tuple[int, int], Tensor]]


def _key(module: ShardedCollection, path: str, table: str) -> str:
    name = module.state_key(table)
    return f"{path}.{name}" if path else name


def _gather(local: dict[str, Any], dst: int | None) -> list[dict[str, Any]]:
    """Every rank's ``local`` on rank ``dst`` (``[]`` elsewhere); ``dst=None``: on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local]
    if dst is None:
        out: list[dict[str, Shards] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(out, local)
        return out  # type: ignore[return-value]
    received: list[dict[str, Shards] | None] | None = None
    if dist.get_rank() == dst:
        received = [None] * dist.get_world_size()
    dist.gather_object(local, received, dst=dst)
    return received or []  # type: ignore[return-value]


def _assemble(pieces: list[dict[str, Shards]], shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """The full tensors of one table from every rank's pieces; each rank's pieces are freed once copied in."""
    full = {k: torch.empty(shape) for k, shape in shapes.items()}  # pages become resident as pieces land
    for i, rank_pieces in enumerate(pieces):
        for key, shards in rank_pieces.items():
            for (r0, c0), t in shards:
                if t.dim() == 1:  # row-wise state (rowwise adagrad): [rows]
                    full[key][r0 : r0 + t.shape[0]] = t
                else:
                    full[key][r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
        pieces[i] = {}
    return full


def _comm_device() -> torch.device:
    """Where tensors travel: the current GPU under NCCL, the host otherwise."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _target(full: Tensor, offsets: tuple[int, int], like: Tensor) -> Tensor:
    r0, c0 = offsets
    if like.dim() == 1:  # row-wise state (rowwise adagrad): [rows]; a step counter: [1]
        return full[r0 : r0 + like.shape[0]]
    return full[r0 : r0 + like.shape[0], c0 : c0 + like.shape[1]]


def _gather_tensors(
    local: dict[str, Any], dst: int, shapes: Callable[[list[dict[str, Shards]]], dict[str, tuple[int, ...]]]
) -> dict[str, Tensor]:
    """Collective: one table's pieces from every rank into full host tensors on rank ``dst`` (``{}`` elsewhere).

    Only their shapes travel as objects; each piece is sent as a tensor and received into its
    place in the full tensor (into a piece-sized buffer first when that place is not contiguous,
    or under NCCL), so rank ``dst`` holds the table and at most one piece in flight.
    """
    rank = dist.get_rank()
    described = {k: [(o, torch.empty(t.shape, dtype=t.dtype, device="meta")) for o, t in v] for k, v in local.items()}
    metas = _gather(described, dst)
    device = _comm_device()
    if rank != dst:
        for key in sorted(local):  # the order rank ``dst`` receives in
            for _, t in local[key]:
                dist.send(t.to(device).contiguous(), dst)
        return {}
    full = {k: torch.empty(shape) for k, shape in shapes(metas).items()}  # pages become resident as pieces land
    for source, described_pieces in enumerate(metas):
        for key in sorted(described_pieces):
            for i, (offsets, like) in enumerate(described_pieces[key]):
                target = _target(full[key], offsets, like)
                if source == dst:
                    target.copy_(local[key][i][1])
                elif device.type == "cpu" and target.is_contiguous() and target.dtype == like.dtype:
                    dist.recv(target, source)
                else:
                    buffer = torch.empty(like.shape, dtype=like.dtype, device=device)
                    dist.recv(buffer, source)
                    target.copy_(buffer)
                    del buffer
    return full


FullTable = tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]


def iter_full_state(sharded: Mapping[str, ShardedCollection], dst: int | None = None) -> Iterator[FullTable]:
    """Collective: each table's full weight and fused optimizer state in turn, in host memory.

    Yields ``(weights, states)`` per table (and per dynamic table's id mapping): ``weights``
    by the unsharded model's key, ``states`` by weight key then state name. Each rank sends
    its shards of one table to rank ``dst``, which receives them in place in the full
    tensors (:func:`_gather_tensors`), so rank ``dst`` holds one table (and a piece in
    flight) at a time if the caller drops each one before asking for the next; ranks other
    than ``dst`` get empty dicts. ``dst=None`` gathers on every rank (``all_gather_object``:
    for tests and small models). Every rank must exhaust the iterator.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    for path, module in sharded.items():
        local_weights, local_states = module.local_shards(), module.local_states()
        for cfg in module.table_configs():  # every rank: every table, the same order
            key = _key(module, path, cfg.name)
            mine = [(m.shard_offsets, w.detach().cpu()) for m, w in local_weights.get(cfg.name, [])]
            states = _table_states(key, local_states.get(cfg.name, []))

            def shapes(pieces: list[dict[str, Shards]], key: str = key, cfg: Any = cfg) -> dict[str, tuple[int, ...]]:
                found: dict[str, tuple[int, ...]] = {key: (cfg.num_embeddings, cfg.embedding_dim)}
                for rank_pieces in pieces:  # state keys that live only on other ranks
                    for name, shards in rank_pieces.items():
                        if name != key and shards:
                            found.setdefault(name, _state_shape(name, cfg, shards))
                return found

            if dst is not None and dist.is_initialized() and dist.get_world_size() > 1:
                full = _gather_tensors({key: mine, **states}, dst, shapes)
            else:
                pieces = _gather({key: mine, **states}, dst)
                full = _assemble(pieces, shapes(pieces))
                del pieces
            del mine, states
            if dst is not None and rank != dst:
                yield {}, {}
                continue
            weights, nested = {key: full.pop(key)}, _nest(full)
            del full
            yield weights, nested
            del weights, nested  # not held while the next table is gathered
        mappers = local_mappers(module)
        for cfg in dynamic_configs(module):  # the id mapping: global tensors, like the unsharded module's
            layout, prefix = DynamicLayout.of(cfg), mapper_prefix(path, cfg.name)
            chunks = _gather(mapper_chunks(layout, prefix, mappers.get(cfg.name)), dst)
            yield (assemble(layout, prefix, chunks) if dst is None or rank == dst else {}), {}
            del chunks


def _nest(full: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """``<weight key>/<state>`` tensors by weight key, then state name (a step counter as a scalar)."""
    nested: dict[str, dict[str, Tensor]] = {}
    for name, t in full.items():
        weight_key, state = name.rsplit("/", 1)
        nested.setdefault(weight_key, {})[state] = t.reshape(()) if state == "step" else t
    return nested


def gather_full_state(
    sharded: Mapping[str, ShardedCollection], dst: int | None = None
) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    """Collective: every table's full weight and full fused optimizer state, all at once, in host memory.

    :func:`iter_full_state` collected: rank ``dst`` ends up holding every table (``dst=None``:
    every rank, for tests and small models); ranks other than ``dst`` return empty dicts.
    """
    weights: dict[str, Tensor] = {}
    nested: dict[str, dict[str, Tensor]] = {}
    for table_weights, table_states in iter_full_state(sharded, dst):
        weights.update(table_weights)
        for weight_key, states in table_states.items():
            nested.setdefault(weight_key, {}).update(states)
    return weights, nested


def _table_states(key: str, shards: list[tuple[Any, dict[str, Tensor]]]) -> dict[str, Shards]:
    """This rank's fused state of one table on the host, keyed ``<weight key>/<state>[@<first column>]``."""
    states: dict[str, Shards] = {}
    for meta, state in shards:
        for name, t in state.items():
            full = f"{key}/{name}"
            if t.dim() == 1:  # one value per row *of this column piece*: keyed by its first column
                full = f"{full}@{meta.shard_offsets[1]}"
            if t.dim() == 0:  # a step counter, the same for every shard
                states[full] = [((0, 0), t.detach().cpu().reshape(1))]
                continue
            states.setdefault(full, []).append((meta.shard_offsets, t.detach().cpu()))
    return states


def _state_shape(key: str, cfg: Any, shards: Shards) -> tuple[int, ...]:
    if key.rsplit("/", 1)[1] == "step":
        return (1,)
    return (cfg.num_embeddings,) + ((cfg.embedding_dim,) if shards[0][1].dim() == 2 else ())


def load_full_state(
    sharded: Mapping[str, ShardedCollection],
    weights: Mapping[str, Tensor] | None = None,
    states: Mapping[str, Mapping[str, Tensor]] | None = None,
    also: Sequence[str] = (),
    copy: Callable[[Tensor, Tensor], None] | None = None,
) -> None:
    """Copy this rank's slices of full ``weights`` and/or fused ``states`` into its shards
    (``copy(dest, source)``: how, ``dest.copy_(source)`` by default).

    Collective when a process group is up: every rank checks everything first (missing
    and unexpected tables, shapes, optimizer states; plus the problems ``also`` found
    elsewhere, e.g. :func:`dense_problems`), and all raise the same
    :class:`CheckpointError` before anything is copied.
    """
    problems: list[str] = list(also)
    copies: list[tuple[Tensor, Tensor]] = []
    changed: set[str] = set()
    if weights is not None:
        named, changed = dynamic_problems(sharded, {k: tuple(v.shape) for k, v in weights.items()})
        problems += named
    for path, module in sharded.items():
        configs = {c.name: c for c in module.table_configs()}
        if weights is not None:
            problems += _weight_problems(module, path, weights, changed)
            copies += _mapping_copies(module, path, weights, changed)
            for table, shards in module.local_shards().items():
                key = _key(module, path, table)
                if key in weights and tuple(weights[key].shape) == _size(configs[table]):
                    for meta, w in shards:
                        (r0, c0), (rows, cols) = meta.shard_offsets, meta.shard_sizes
                        copies.append((w, weights[key][r0 : r0 + rows, c0 : c0 + cols]))
        if states is None:
            continue
        for table, state_shards in module.local_states().items():
            key, cfg = _key(module, path, table), configs[table]
            if key in changed:  # refused by name above
                continue
            saved = states.get(key, {})
            for meta, state in state_shards:
                for name, t in state.items():
                    source = _state_source(saved, name, t, meta.shard_offsets[1], cfg)
                    if isinstance(source, str):
                        problems.append(f"optimizer state '{key}/{name}': {source}")
                        continue
                    (r0, c0), (rows, cols) = meta.shard_offsets, meta.shard_sizes
                    if t.dim() == 0:
                        copies.append((t, source.reshape(())))
                    elif t.dim() == 1:
                        copies.append((t, source[r0 : r0 + rows]))
                    else:
                        copies.append((t, source[r0 : r0 + rows, c0 : c0 + cols]))
    problems = pooled(list(dict.fromkeys(problems)))
    if problems:
        raise CheckpointError("checkpoint does not match the model; nothing was loaded:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for dest, source in copies:
            if copy is None:
                dest.copy_(source)
            else:
                copy(dest, source)


def dense_problems(model: Mapping[str, Any], saved: Mapping[str, Any], strict: bool = True) -> list[str]:
    """Shape mismatches between ``saved`` and ``model`` state; with ``strict``, missing and unexpected keys."""
    problems = []
    for key, value in saved.items():
        if key not in model:
            if strict:
                problems.append(f"'{key}': in the checkpoint, not in the model")
        elif isinstance(value, Tensor) and isinstance(model[key], Tensor) and value.shape != model[key].shape:
            problems.append(
                f"'{key}': checkpoint has shape {tuple(value.shape)}, model expects {tuple(model[key].shape)}"
            )
    if strict:
        problems += [f"'{key}': in the model, missing from the checkpoint" for key in model if key not in saved]
    return problems


def _size(cfg: Any) -> tuple[int, int]:
    return (cfg.num_embeddings, cfg.embedding_dim)


def _mapping_copies(
    module: ShardedCollection, path: str, state: Mapping[str, Tensor], changed: set[str]
) -> list[tuple[Tensor, Tensor]]:
    """This rank's mappers' slices of the saved global mapping tensors (tables whose keys are all there)."""
    copies = []
    mappers = local_mappers(module)
    for cfg in dynamic_configs(module):
        prefix, mapper = mapper_prefix(path, cfg.name), mappers.get(cfg.name)
        layout = DynamicLayout.of(cfg)
        fits = all(tuple(state[prefix + b].shape) == layout.size(b) for b in BUFFERS if prefix + b in state)
        if mapper is not None and prefix not in changed and fits and all(prefix + b in state for b in BUFFERS):
            copies += mapper_copies(layout, prefix, mapper, state)
    return copies


def _weight_problems(
    module: ShardedCollection, path: str, weights: Mapping[str, Tensor], changed: AbstractSet[str] = frozenset()
) -> list[str]:
    """Every table of ``module`` missing from ``weights`` or of another shape; tables the module lacks.

    Tables in ``changed`` (dynamic tables refused by name, see :func:`.dynamic_state.dynamic_problems`) are skipped.
    """
    problems = []
    known = set()
    for cfg in module.table_configs():
        key = _key(module, path, cfg.name)
        known.add(key)
        if key in changed:
            continue
        if key not in weights:
            problems.append(f"'{key}': in the model, missing from the checkpoint")
        elif tuple(weights[key].shape) != _size(cfg):
            problems.append(f"'{key}': checkpoint has shape {tuple(weights[key].shape)}, model expects {_size(cfg)}")
    if not module.weight_prefix:  # one table under the module's own key: nothing else can be "unexpected"
        return problems
    prefix = _key(module, path, "")[: -len(".weight")]
    problems += [f"'{k}': in the checkpoint, not in the model" for k in sorted(weights) if _under(k, prefix, known)]
    return problems


def _under(key: str, prefix: str, known: set[str]) -> bool:
    return key.startswith(prefix) and key.endswith(".weight") and key not in known


def _state_source(saved: Mapping[str, Tensor], name: str, t: Tensor, col: int, cfg: Any) -> Tensor | str:
    """The saved full tensor a shard's state ``name`` is sliced from, or why there is none."""
    expected: tuple[int, ...]
    found: tuple[int, ...]
    if t.dim() == 1:  # per row of a column piece, saved as ``name@<first column>``
        starts = [int(k.split("@", 1)[1]) for k in saved if k.startswith(f"{name}@")]
        if not any(c <= col for c in starts):
            return "missing from the checkpoint"
        source, expected = _row_state(saved, name, col), (cfg.num_embeddings,)
        found = tuple(source.shape)
    else:
        if name not in saved:
            return "missing from the checkpoint"
        source = saved[name]
        expected, found = ((1,), (source.numel(),)) if t.dim() == 0 else (_size(cfg), tuple(source.shape))
    if found != expected:
        return f"checkpoint has shape {found}, model expects {expected}"
    return source


def _row_state(saved: Mapping[str, Tensor], name: str, col: int) -> Tensor:
    """A per-row state saved per column piece (``name@<first column>``): the piece holding ``col``.

    Exact when the plan is unchanged; a different column split takes the state of the
    saved piece its first column falls in.
    """
    starts = sorted(int(k.split("@", 1)[1]) for k in saved if k.startswith(f"{name}@"))
    return saved[f"{name}@{max(c for c in starts if c <= col)}"]
