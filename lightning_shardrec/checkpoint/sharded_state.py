"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes its shards.

Tables (and their fused optimizer state) enter the DCP state dict as
``ShardedTensor``s whose global metadata comes from the sharding plan, under the
unsharded module's keys (``<path>.embedding_bags.<table>.weight``). Loading builds
the same structure from the *current* plan, with the kernels' own storage as the
local shards, and DCP reads whatever overlaps: a checkpoint saved by 2 ranks
row-wise loads into 3 ranks column-wise, in place, without gathering a table.

Per-row optimizer state (row-wise Adagrad) belongs to one column piece, so it is
keyed by the piece's first column (``.../sum@8``); a different column split takes
the state of the saved piece its first column falls in.

A dynamic table's id mapping enters as global tensors chunked by bucket range
(:mod:`.dynamic_state`), so it reshards like a row-wise table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.checkpoint.atomic import (
    agree_failures,
    agree_token,
    clean_stale,
    commit,
    describe,
    remove_path,
    save_file,
    staging_path,
    sync,
)
from lightning_shardrec.checkpoint.dcp_writer import storage_writer
from lightning_shardrec.checkpoint.dynamic_state import (
    DynamicLayout,
    bucket_ranges,
    dynamic_configs,
    dynamic_expected,
    dynamic_problems,
    local_mappers,
    mapper_pieces,
    mapper_prefix,
)
from lightning_shardrec.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_file,
    load_local,
    read_metadata,
    set_element,
)
from lightning_shardrec.checkpoint.stored_tensor import stored_weights
from lightning_shardrec.checkpoint.validate import (
    expected_sizes,
    file_problems,
    metadata_problems,
    pooled,
    raise_if_any,
    undecodable,
)
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.planner import ShardingType, ShardMetadata

if TYPE_CHECKING:
    from lightning_shardrec._compat.torch import ShardedTensor


#: the most bytes one saved piece holds: a shard is written (and read back) in row chunks of at most
#: this size, so resuming stages one chunk at a time rather than a whole shard (1M rows of 16 fp32)
PIECE_BYTES = 64 * 2**20

Piece = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, rank


def row_pieces(offsets: tuple[int, ...], sizes: tuple[int, ...], rank: int, row_bytes: int) -> list[Piece]:
    """``(offsets, sizes, rank)`` cut along rows into pieces of at most :data:`PIECE_BYTES` (one row at least)."""
    step = max(1, PIECE_BYTES // max(1, row_bytes))
    rows = sizes[0]
    if rows <= step:
        return [(tuple(offsets), tuple(sizes), rank)]
    return [((offsets[0] + a, *offsets[1:]), (min(step, rows - a), *sizes[1:]), rank) for a in range(0, rows, step)]


def own_storage(t: Tensor) -> Tensor:
    """``t`` (a view into a kernel's flat buffer) as a tensor whose storage is exactly its bytes, same memory.

    DCP's writer clones every tensor whose storage is larger than itself and keeps the clones until
    the rank's file is closed (a second copy of the rank's share); a CPU tensor with its own
    storage is written from where it lies. Loading writes through it into the buffer.
    """
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return t
    raw = torch.from_numpy(t.detach().reshape(-1).view(torch.uint8).numpy())  # shares t's memory
    return raw.view(t.dtype).view(t.shape)


def _sharded(
    size: tuple[int, ...],
    shards: Sequence[tuple[Sequence[int], Sequence[int], int]],
    local: Sequence[tuple[Sequence[int], Tensor]],
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> ShardedTensor:
    """A ShardedTensor over ``local`` views, with the plan's ``shards`` as global metadata (no collective),
    each shard cut into row pieces of at most :data:`PIECE_BYTES` (see :func:`row_pieces`)."""
    device = local[0][1].device if local else torch.device("cpu")
    dtype = local[0][1].dtype if local else dtype
    row_bytes = math.prod(size[1:]) * torch.empty(0, dtype=dtype).element_size()
    pieces = [p for o, s, r in shards for p in row_pieces(tuple(o), tuple(s), r, row_bytes)]
    by_offset: dict[tuple[int, ...], Tensor] = {}
    for offsets, t in local:
        for o, s, _ in row_pieces(tuple(offsets), tuple(t.shape), rank, row_bytes):
            by_offset[tuple(o)] = own_storage(t.narrow(0, o[0] - offsets[0], s[0]))
    return compat.sharded_tensor_from_plan(size, dtype, device, pieces, by_offset, rank)


def _plan_shards(module: ShardedCollection, table: str) -> tuple[ShardingType, list[ShardMetadata]]:
    kinds: set[ShardingType] = set()
    shards: list[ShardMetadata] = []
    for g in module.groups:
        for t in g.tables:
            if t.config.name == table:
                kinds.add(t.plan.sharding_type)
                shards.extend(t.plan.shards)
    return kinds.pop(), sorted(set(shards), key=lambda s: (s.shard_offsets, s.rank))


def sharded_state_dict(
    sharded: Mapping[str, ShardedCollection], rank: int, saved_keys: set[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """``(tables, fused_states, more_fused)`` for DCP, keyed like the unsharded model.

    With ``saved_keys`` (loading), per-row states are requested under the saved key of
    the piece each local piece starts in; when two local pieces read the same saved
    piece, the second goes to ``more_fused`` (to load in a separate pass).
    """
    tables: dict[str, Any] = {}
    fused: dict[str, Any] = {}
    more: list[dict[str, Any]] = []
    for path, module in sharded.items():
        configs = {c.name: c for c in module.table_configs()}
        local = module.local_shards()
        states = module.local_states()
        for table, cfg in configs.items():
            key = f"{path}.{module.state_key(table)}" if path else module.state_key(table)
            size = (cfg.num_embeddings, cfg.embedding_dim)
            kind, plan = _plan_shards(module, table)
            mine = local.get(table, [])
            if kind is ShardingType.DATA_PARALLEL:  # replicated: a plain tensor, written once
                tables[key] = mine[0][1]
                continue
            shards = [(s.shard_offsets, s.shard_sizes, s.rank) for s in plan]
            tables[key] = _sharded(size, shards, [(m.shard_offsets, w) for m, w in mine], rank)
            per_state: dict[str, list[tuple[ShardMetadata, Tensor]]] = {}
            for meta, state in states.get(table, []):
                for name, t in state.items():
                    per_state.setdefault(name, []).append((meta, t))
            for name, views in sorted(per_state.items()):  # ranks without a shard add nothing
                if views[0][1].dim() == 0:  # a step counter, equal on every rank that has one
                    fused[f"{key}/{name}"] = views[0][1]
                elif views[0][1].dim() == 2:
                    fused[f"{key}/{name}"] = _sharded(size, shards, [(m.shard_offsets, t) for m, t in views], rank)
                else:  # one value per row of a column piece
                    for col in sorted({m.shard_offsets[1] for m, _ in views}):
                        piece = [s for s in plan if s.shard_offsets[1] == col]
                        rows = [((s.shard_offsets[0],), (s.shard_sizes[0],), s.rank) for s in piece]
                        mine_rows = [((m.shard_offsets[0],), t) for m, t in views if m.shard_offsets[1] == col]
                        state_key = f"{key}/{name}@{col}"
                        if saved_keys is not None:
                            state_key = _saved_piece(saved_keys, f"{key}/{name}", col)
                        value = _sharded((cfg.num_embeddings,), rows, mine_rows, rank)
                        target = next((d for d in [fused, *more] if state_key not in d), None)
                        if target is None:
                            more.append(target := {})
                        target[state_key] = value
        tables.update(_mapper_entries(path, module, rank))
    return tables, fused, more


def _mapper_entries(path: str, module: ShardedCollection, rank: int) -> dict[str, Any]:
    """This rank's view of every dynamic table's mapping: ShardedTensors by bucket range, ``step`` plain."""
    out: dict[str, Any] = {}
    mappers = local_mappers(module)
    for cfg in dynamic_configs(module):
        layout, ranges = DynamicLayout.of(cfg), bucket_ranges(module, cfg)
        for piece in mapper_pieces(layout, mapper_prefix(path, cfg.name), ranges, mappers.get(cfg.name)):
            local = [] if piece.local is None else [(piece.offsets, piece.local)]
            if piece.chunks:
                out[piece.key] = _sharded(piece.size, piece.chunks, local, rank, dtype=torch.int64)
            elif piece.local is not None:  # written once (DCP keeps one copy of a replicated tensor)
                out[piece.key] = piece.local
    return out


def _saved_piece(saved_keys: set[str], prefix: str, col: int) -> str:
    starts = sorted(int(k.rsplit("@", 1)[1]) for k in saved_keys if k.startswith(f"{prefix}@"))
    fits = [c for c in starts if c <= col]
    return f"{prefix}@{fits[-1] if fits else col}"


def saved_keys(path: str | Path) -> set[str]:
    """Every key a DCP checkpoint holds (flattened, as DCP names them); its metadata is read by an allow-list."""
    return set(read_metadata(path).state_dict_metadata)


def save_sharded(
    path: str | Path,
    sharded: Mapping[str, ShardedCollection],
    dense: dict[str, Tensor],
    meta: dict[str, Any],
    rank: int,
) -> None:
    """Collective: tables, fused state and ``dense`` entries via DCP into directory ``path``;
    ``meta`` (loops, dense optimizers, plan: all replicated) as ``path/meta.pt`` from rank 0.

    Atomic (see :mod:`~lightning_shardrec.checkpoint.atomic`): written beside ``path`` and
    swapped in once every rank has finished. A failure on any rank raises
    :class:`CheckpointError` on every rank and leaves whatever was at ``path`` untouched.
    """
    path = Path(path)
    staging = staging_path(path, agree_token())
    tables, fused, _ = sharded_state_dict(sharded, rank)
    error: BaseException | None = None
    try:
        if rank == 0:
            clean_stale(path, keep=staging)
            staging.mkdir(parents=True, exist_ok=True)
            (staging / SHARED_MARK).touch()
    except Exception as e:
        error = e
    failures = agree_failures(error)  # also: rank 0's directory exists before any rank looks for it
    if not failures:
        error = _check_shared(staging, rank)
        failures = agree_failures(error)
    if not failures:
        try:
            state = _non_empty({"state_dict": {**dense, **tables}, "fused": fused})
            dcp.save(state, storage_writer=storage_writer(staging, state))  # host copies bounded on GPUs
            if rank == 0:
                torch.save(meta, staging / META_FILE)
                (staging / SHARED_MARK).unlink()
        except (Exception, CheckpointException) as e:  # agreed on below, so no rank waits for one that gave up
            error = e
        failures = agree_failures(error)
    if not failures and rank == 0:
        try:
            commit(staging, path)
        except OSError as e:
            error = e
    failures = failures or agree_failures(error)
    if failures:
        if rank == 0:
            remove_path(staging)
        sync()  # every rank returns with the staging directory gone
        raise CheckpointError(
            f"saving checkpoint '{path}' failed; what was there before is untouched:\n  " + "\n  ".join(failures)
        ) from error


def _check_shared(staging: Path, rank: int) -> CheckpointError | None:
    """Every rank writes into the directory rank 0 made: without a shared file system the files would scatter."""
    if (staging / SHARED_MARK).exists():
        return None
    return CheckpointError(
        f"rank {rank} does not see '{staging}', which rank 0 created: a sharded checkpoint directory must be on a "
        "file system every rank shares (NFS, Lustre, a mounted bucket); use a shared path or checkpoint_format='full'"
    )


def load_sharded(
    path: str | Path, sharded: Mapping[str, ShardedCollection], dense: dict[str, Tensor], rank: int
) -> dict[str, Any]:
    """Collective: read ``path`` into this rank's shards and ``dense`` tensors in place; return meta.

    Everything is checked first (metadata, ``meta.pt``, keys, shapes, shard files; see
    :mod:`~lightning_shardrec.checkpoint.validate`): a checkpoint that does not fit raises
    :class:`CheckpointError` on every rank before anything is written. No pickled code runs.
    """
    path = Path(path)
    problems: list[str] = []
    meta: dict[str, Any] = {}
    state: dict[str, Any] = {}
    more: list[dict[str, Any]] = []
    try:
        metadata = read_metadata(path)
        meta = load_file(path / META_FILE, "checkpoint file")
    except CheckpointError as e:
        problems.append(str(e))
    else:
        keys = {k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("fused.")}
        tables, fused, more = sharded_state_dict(sharded, rank, saved_keys=keys)
        state = _non_empty({"state_dict": {**dense, **tables}, "fused": fused})
        expected = expected_sizes(state)
        for extra in more:
            expected.update(expected_sizes({"fused": extra}))
        expected.update({f"state_dict.{k}": size for k, size in dynamic_expected(sharded).items()})
        shapes = {
            k.split(".", 1)[1]: tuple(md.size)
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith("state_dict.") and hasattr(md, "size")
        }
        named, changed = dynamic_problems(sharded, shapes)
        problems += named + metadata_problems(metadata, expected, ignore=tuple(changed)) + file_problems(path, metadata)
    raise_if_any(path, pooled(problems))
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        for extra in more:
            dcp.load({"fused": extra}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"reading checkpoint '{path}' failed although its metadata matches the model; the model is partly "
            "loaded and must not be used:\n  " + "\n  ".join(undecodable(path, metadata) or describe(e))
        ) from e
    return meta


def _non_empty(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """DCP takes an empty nested dict for a leaf; a rank holding no shard sends none."""
    return {k: v for k, v in state.items() if v}


def convert_to_full(checkpoint_dir: str | Path, out_file: str | Path) -> None:
    """Turn a sharded checkpoint directory into one full checkpoint file (one process, no group).

    The result has the unsharded model's keys, so ``LightningModule.load_from_checkpoint`` and
    inference code read it directly. The checkpoint is read without running pickled code and
    ``out_file`` is replaced atomically.
    """
    save_file(read_full(checkpoint_dir), Path(out_file))


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a local directory written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def read_full(checkpoint_dir: str | Path, lazy: bool = False) -> dict[str, Any]:
    """A sharded checkpoint directory as one full checkpoint dict (one process, no group, no pickled code).

    Reads the weights only (tables and dense), not the fused optimizer state: peak about the model's size.
    With ``lazy``, every weight of at least :data:`LAZY_BYTES` is a
    :class:`~lightning_shardrec.checkpoint.stored_tensor.StoredTensor` instead, read when used:
    ``Module.load_state_dict`` copies each one straight from the files into the model, one saved
    piece at a time (peak: the model and one piece).
    """
    checkpoint_dir = Path(checkpoint_dir)
    metadata = read_metadata(checkpoint_dir)
    raise_if_any(checkpoint_dir, file_problems(checkpoint_dir, metadata))
    meta = load_file(checkpoint_dir / META_FILE, "checkpoint file")
    stored = stored_weights(checkpoint_dir, metadata, LAZY_BYTES) if lazy else {}
    eager = [k for k in metadata.state_dict_metadata if k.startswith("state_dict.") and k not in stored]
    full: dict[str, Any] = {}
    for key in eager:  # the weights only: the fused optimizer state (as large as the tables, or twice) is not read
        md = metadata.state_dict_metadata[key]
        value = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        set_element(full, (metadata.planner_data or {}).get(key, (key,)), value)  # a non-tensor: read in its place
    try:
        if full:
            load_local(full, checkpoint_dir)
    except CheckpointException as e:
        raise CheckpointError(f"reading checkpoint '{checkpoint_dir}' failed:\n  " + "\n  ".join(describe(e))) from None
    if not lazy:
        meta["state_dict"] = full["state_dict"]
        return meta
    loaded, state = full.get("state_dict", {}), {}
    for key in metadata.state_dict_metadata:  # the saved order
        path = (metadata.planner_data or {}).get(key, ())
        if key in stored:
            state[stored[key]._path[1]] = stored[key]
        elif len(path) > 1 and path[0] == "state_dict" and path[1] in loaded:
            state.setdefault(path[1], loaded[path[1]])
    meta["state_dict"] = state
    return meta


#: entries at least this large are read when used under ``read_full(lazy=True)``; smaller ones at once
LAZY_BYTES = 2**20
META_FILE = "meta.pt"
SHARED_MARK = ".shared"  # rank 0's marker in the staging directory: proves every rank sees it
