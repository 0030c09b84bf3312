"""Full (unsharded) checkpoints of sharded collections: sliced into the shards on load.

A full state dict uses the unsharded module's keys (``<path>.embedding_bags.<table>.weight``,
``<path>.embeddings.<table>.weight``),
so it loads into the plain model (``LightningModule.load_from_checkpoint``, inference)
and into a sharded model of *any* world size or plan: resharding is slicing. Fused
optimizer state travels the same way, keyed by the weight's name. A dynamic table's
id mapping is gathered into, and sliced from, the unsharded module's global tensors
(:mod:`.dynamic_state`).

Saving gathers the tables on rank 0 only, one tensor at a time (:mod:`.full_gather`); this
module is the loading half.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.checkpoint.dynamic_state import (
    DynamicLayout,
    dynamic_configs,
    dynamic_problems,
    local_mappers,
    mapper_copies,
    mapper_prefix,
)
from lightning_shardrec.checkpoint.full_gather import state_key
from lightning_shardrec.checkpoint.validate import pooled
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.modules.dynamic.layout import BUFFERS


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
                key = state_key(module, path, table)
                if key in weights and tuple(weights[key].shape) == _size(configs[table]):
                    for meta, w in shards:
                        (r0, c0), (rows, cols) = meta.shard_offsets, meta.shard_sizes
                        copies.append((w, weights[key][r0 : r0 + rows, c0 : c0 + cols]))
        if states is None:
            continue
        for table, state_shards in module.local_states().items():
            key, cfg = state_key(module, path, table), configs[table]
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
        key = state_key(module, path, cfg.name)
        known.add(key)
        if key in changed:
            continue
        if key not in weights:
            problems.append(f"'{key}': in the model, missing from the checkpoint")
        elif tuple(weights[key].shape) != _size(cfg):
            problems.append(f"'{key}': checkpoint has shape {tuple(weights[key].shape)}, model expects {_size(cfg)}")
    if not module.weight_prefix:  # one table under the module's own key: nothing else can be "unexpected"
        return problems
    prefix = state_key(module, path, "")[: -len(".weight")]
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
