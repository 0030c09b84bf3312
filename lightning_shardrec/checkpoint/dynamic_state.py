"""Dynamic tables' id mappings in checkpoints: global tensors chunked by bucket range.

Each rank's :class:`~lightning_shardrec.modules.DynamicIdMapper` holds buckets
``[lo, hi)`` of a dynamic table; in a checkpoint its buffers are chunks of the global
tensors the unsharded module saves (:mod:`~lightning_shardrec.modules.dynamic.layout`),
under the same keys (``<path>.dynamic_tables.<table>.<buffer>``). A sharded (DCP)
checkpoint stores them as ``ShardedTensor`` chunks, so another world size reads the
overlap of its own bucket ranges, as for row-wise tables; a full checkpoint stores the
global tensors, so it *is* the unsharded state dict. ``step`` is the same on every rank
and stored once.

These are the pure pieces (no collectives): :mod:`.sharded_state` and :mod:`.full_state`
call them for every sharded collection.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.modules.dynamic.layout import BUFFERS, DynamicLayout, layout_problems
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper

Chunks = dict[str, list[tuple[tuple[int, ...], Tensor]]]
"""``key -> [(offsets, chunk)]``: pieces of global tensors, as ranks send them to be assembled."""


@dataclass(frozen=True)
class MapperPiece:
    """One buffer of one dynamic table for DCP, as this rank sees it.

    ``chunks``: every rank's ``(offsets, sizes, rank)`` (``[]``: stored as one plain tensor,
    for ``step`` and empty buffers); ``local``: this rank's buffer at ``offsets``
    (``None``: no buckets of the table here).
    """

    key: str
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]]
    offsets: tuple[int, ...]
    local: Tensor | None


def dynamic_configs(module: ShardedCollection) -> list[BaseEmbeddingConfig]:
    """The collection's dynamic tables (the same list on every rank)."""
    return [c for c in module.table_configs() if c.dynamic is not None]


def mapper_prefix(path: str, table: str) -> str:
    """State-dict prefix of ``table``'s mapping buffers in the unsharded model."""
    return f"{path}.dynamic_tables.{table}." if path else f"dynamic_tables.{table}."


def local_mappers(module: ShardedCollection) -> dict[str, DynamicIdMapper]:
    """This rank's mappers by table (``dynamic_mappers()`` of the sharded collection)."""
    return module.dynamic_mappers()


def bucket_ranges(module: ShardedCollection, config: BaseEmbeddingConfig) -> list[tuple[int, int, int]]:
    """``(lo, hi, rank)`` of every rank's buckets of dynamic ``config``, from the plan (no collective)."""
    slots = DynamicLayout.of(config).slots_per_bucket
    rows = {
        (s.shard_offsets[0], s.shard_sizes[0], s.rank)
        for g in module.groups
        for t in g.tables  # type: ignore[union-attr]
        if t.config.name == config.name
        for s in t.plan.shards
    }
    return sorted((r0 // slots, (r0 + n) // slots, rank) for r0, n, rank in rows)


def mapper_pieces(
    layout: DynamicLayout, prefix: str, ranges: list[tuple[int, int, int]], mapper: DynamicIdMapper | None
) -> Iterator[MapperPiece]:
    """Every buffer of one table's mapping, for a DCP state dict (``mapper``: this rank's, if any)."""
    if mapper is not None:
        mine = (mapper.bucket_lo, mapper.bucket_hi)
        if not any((lo, hi) == mine for lo, hi, _ in ranges):  # internal invariant, not user input
            raise RuntimeError(f"dynamic table '{layout.table}': mapper over buckets {mine}, plan {ranges}")
    for name in BUFFERS:
        size = layout.size(name)
        plain = name == "step" or math.prod(size) == 0
        chunks = [] if plain else [(*layout.chunk(name, lo, hi), rank) for lo, hi, rank in ranges]
        local = None if mapper is None else getattr(mapper, name)
        offsets = () if mapper is None else layout.chunk(name, mapper.bucket_lo, mapper.bucket_hi)[0]
        yield MapperPiece(prefix + name, size, chunks, offsets, local)


def mapper_chunks(layout: DynamicLayout, prefix: str, mapper: DynamicIdMapper | None) -> Chunks:
    """This rank's chunks of one table's mapping on the host (``{}`` without a mapper)."""
    if mapper is None:
        return {}
    lo, hi = mapper.bucket_lo, mapper.bucket_hi
    return {
        prefix + name: [(layout.chunk(name, lo, hi)[0], getattr(mapper, name).to("cpu", copy=True))] for name in BUFFERS
    }


def assemble(layout: DynamicLayout, prefix: str, pieces: list[Chunks]) -> dict[str, Tensor]:
    """The global tensors of one table's mapping from every rank's :func:`mapper_chunks`."""
    full = {prefix + name: torch.zeros(layout.size(name), dtype=torch.int64) for name in BUFFERS}
    for rank_chunks in pieces:
        for key, chunks in rank_chunks.items():
            for offsets, t in chunks:
                if t.dim() == 0:
                    full[key] = t.clone()
                else:
                    full[key][tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))] = t
    return full


def mapper_copies(
    layout: DynamicLayout, prefix: str, mapper: DynamicIdMapper, full: Mapping[str, Tensor]
) -> list[tuple[Tensor, Tensor]]:
    """``(buffer, slice of the global tensor)`` pairs that load ``mapper``'s buckets from ``full``."""
    out = []
    for name in BUFFERS:
        offsets, sizes = layout.chunk(name, mapper.bucket_lo, mapper.bucket_hi)
        source = full[prefix + name]
        out.append((getattr(mapper, name), source[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]))
    return out


def saved_shapes(prefix: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``buffer -> shape`` of one table's mapping among a checkpoint's ``key -> shape``."""
    return {name: tuple(shapes[prefix + name]) for name in BUFFERS if prefix + name in shapes}


def dynamic_problems(
    sharded: Mapping[str, ShardedCollection], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], set[str]]:
    """Problems of a checkpoint's mappings (``key -> global shape``) and the tables whose layout changed.

    The second item holds, for every table refused by name (:func:`layout_problems`), the
    prefixes of its keys (weight and mapping), whose generic shape problems would only repeat it.
    A mapping saved for a table that is not dynamic in the model is reported (and its prefix returned) too.
    """
    problems: list[str] = []
    changed: set[str] = set()
    for path, module in sharded.items():
        dynamic = {c.name for c in dynamic_configs(module)}
        for cfg in dynamic_configs(module):
            prefix = mapper_prefix(path, cfg.name)
            wkey = f"{path}.{module.state_key(cfg.name)}" if path else module.state_key(cfg.name)
            weight = shapes.get(wkey)
            dim = weight[1] if weight is not None and len(weight) == 2 else None
            found = layout_problems(DynamicLayout.of(cfg), saved_shapes(prefix, shapes), dim, prefix)
            problems += found
            if any(p.startswith("dynamic table") for p in found):
                changed.update((prefix, wkey))
        root = f"{path}.dynamic_tables." if path else "dynamic_tables."
        saved = sorted({k[len(root) :].rsplit(".", 1)[0] for k in shapes if k.startswith(root)})
        for table in (t for t in saved if t not in dynamic):
            problems.append(
                f"table '{table}': the checkpoint holds an id mapping for it ('{root}{table}.*': saved as a dynamic "
                "table), the model's table is not dynamic"
            )
            changed.add(mapper_prefix(path, table))
    return problems, changed


def dynamic_expected(sharded: Mapping[str, ShardedCollection]) -> dict[str, tuple[int, ...]]:
    """Every mapping key of every dynamic table with its global shape (whether this rank has buckets or not)."""
    return {
        mapper_prefix(path, cfg.name) + name: DynamicLayout.of(cfg).size(name)
        for path, module in sharded.items()
        for cfg in dynamic_configs(module)
        for name in BUFFERS
    }
