"""Check a sharded checkpoint against the model before a byte of it is loaded.

Every rank checks what it will read: keys present, tensors (not pickled objects)
of the model's shapes, shard files present and long enough. Ranks hold different
shards, so the problems are pooled across ranks and every rank raises the same
:class:`CheckpointError`, one line per problem; the model is untouched.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_shardrec.errors import CheckpointError


def _name(key: str) -> str:
    """``state_dict.ebc.embedding_bags.t.weight`` -> ``'ebc.embedding_bags.t.weight'`` (and fused state likewise)."""
    group, name = key.split(".", 1)
    return f"optimizer state '{name}'" if group == "fused" else f"'{name}'"


def expected_sizes(state: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[int, ...] | None]:
    """Flattened DCP key (``state_dict.<key>``) -> global size (``None``: not a tensor), for a two-level dict."""
    return {
        f"{group}.{key}": tuple(value.size()) if isinstance(value, Tensor) else None
        for group, entries in state.items()
        for key, value in entries.items()
    }


def metadata_problems(
    metadata: Metadata,
    expected: Mapping[str, tuple[int, ...] | None],
    strict_prefix: str = "state_dict.",
    ignore: tuple[str, ...] = (),
) -> list[str]:
    """Missing keys, non-tensor entries and shape mismatches; saved keys under ``strict_prefix`` the model lacks.

    Keys (past their group, ``state_dict.`` / ``fused.``) starting with an ``ignore`` prefix are not
    checked: their problem is already reported another way (a dynamic table whose layout changed).
    """
    saved = metadata.state_dict_metadata
    problems = []
    for key, size in expected.items():
        md = saved.get(key)
        if ignore and key.split(".", 1)[1].startswith(ignore):
            continue
        if md is None:
            problems.append(f"{_name(key)}: in the model, missing from the checkpoint")
        elif size is None:
            continue  # a non-tensor entry: read weights-only (safe_load.SafeLoadPlanner)
        elif not isinstance(md, TensorStorageMetadata):
            problems.append(f"{_name(key)}: the checkpoint holds a pickled object, the model a tensor of shape {size}")
        elif tuple(md.size) != size:
            problems.append(f"{_name(key)}: checkpoint has shape {tuple(md.size)}, model expects {size}")
        elif (held := sum(math.prod(c.sizes) for c in md.chunks)) < math.prod(size):
            problems.append(f"{_name(key)}: checkpoint holds {held} of its {math.prod(size)} values (shards missing)")
    for key in sorted(saved):
        if key.startswith(strict_prefix) and key not in expected and not key.split(".", 1)[1].startswith(ignore):
            problems.append(f"{_name(key)}: in the checkpoint, not in the model")
    return problems


def file_problems(path: Path, metadata: Metadata) -> list[str]:
    """Shard files the metadata names that are missing, truncated or outside the checkpoint directory."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for rel, length in sorted(needed.items()):
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            problems.append(f"shard file {rel!r} lies outside the checkpoint directory")
            continue
        file = path / rel
        if not file.is_file():
            problems.append(f"shard file '{file}' is missing (the metadata expects {length} bytes)")
        elif (size := file.stat().st_size) < length:
            problems.append(f"shard file '{file}' is truncated: {size} bytes, the metadata expects at least {length}")
    return problems


def undecodable(path: Path, metadata: Metadata) -> list[str]:
    """After a failed read: the shard files holding an entry that does not decode (first entry per file)."""
    bad: dict[str, str] = {}
    for info in (metadata.storage_data or {}).values():
        if info.relative_path in bad or info.transform_descriptors:
            continue
        file = path / info.relative_path
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
        except Exception as e:
            at = f"its entry at byte {info.offset} does not decode ({type(e).__name__})"
            bad[info.relative_path] = f"shard file '{file}' is corrupt: {at}"
    return [bad[k] for k in sorted(bad)]


def pooled(problems: list[str]) -> list[str]:
    """Collective: every rank's problems, deduplicated, in first-seen order (identical on all ranks)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return problems
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return list(dict.fromkeys(p for rank in everyone for p in rank or []))


def raise_if_any(path: Path, problems: list[str]) -> None:
    """One :class:`CheckpointError` listing every problem (one a line), or nothing."""
    if problems:
        raise CheckpointError(
            f"checkpoint '{path}' cannot be loaded into this model; nothing was loaded:\n  " + "\n  ".join(problems)
        )
