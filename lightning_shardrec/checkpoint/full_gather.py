"""Full tensors of sharded tables gathered on one rank, one tensor at a time (a full-format save).

A table's weight and each of its fused optimizer states travel on their own: every rank sends its
shards of that one tensor to rank ``dst`` in row pieces of at most
:data:`~lightning_shardrec.checkpoint.sharded_state.PIECE_BYTES`, and rank ``dst`` receives each
piece into its place in the full host tensor. A caller that writes each tensor and drops it before
asking for the next (:func:`iter_full_state`, as the strategy's full-format save does) makes rank
``dst`` hold its share, the largest single full tensor (a weight ``[rows, dim]`` or one state) and
at most one piece in flight; the other ranks hold their share and one piece.

``dst=None`` gathers everything on every rank as objects (``all_gather_object``): for tests and
small models.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.checkpoint import sharded_state
from lightning_shardrec.checkpoint.dynamic_state import (
    DynamicLayout,
    assemble,
    dynamic_configs,
    local_mappers,
    mapper_chunks,
    mapper_prefix,
)
from lightning_shardrec.distributed.collection import ShardedCollection

Shards = list[tuple[tuple[int, int], Tensor]]

FullTensor = tuple[str, str | None, Tensor]
"""``(weight key, state, tensor)``: a table's full weight (``state`` None), one of its fused optimizer
states by name (``sum``, ``exp_avg``, ``sum@<first column>`` for a per-row state, ``step`` as a
scalar), or a dynamic table's id-mapping buffer (its own key, ``state`` None)."""


def state_key(module: ShardedCollection, path: str, table: str) -> str:
    """``table``'s weight key in the unsharded model's state dict."""
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


def _comm_device() -> torch.device:
    """Where tensors travel: the current GPU under NCCL, the host otherwise."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _target(full: Tensor, offsets: tuple[int, int], like: Tensor) -> Tensor:
    """The region of ``full`` a shard shaped like ``like`` fills: ``[rows, cols]``, or ``[rows]`` for a 1-D state."""
    r0, c0 = offsets
    if like.dim() == 1:  # row-wise state (rowwise adagrad): [rows]; a step counter: [1]
        return full[r0 : r0 + like.shape[0]]
    return full[r0 : r0 + like.shape[0], c0 : c0 + like.shape[1]]


def _row_steps(like: Tensor) -> list[slice]:
    """A shard's rows cut into pieces of at most ``PIECE_BYTES`` (one row at least); sender and receiver agree."""
    rows = like.shape[0]
    row_bytes = like[:1].numel() * like.element_size()
    step = max(1, sharded_state.PIECE_BYTES // max(1, row_bytes))
    return [slice(a, min(a + step, rows)) for a in range(0, rows, step)]


def _send(shards: Shards, dst: int, device: torch.device) -> None:
    for _, t in shards:
        for rows in _row_steps(t):
            dist.send(t[rows].to(device).contiguous(), dst)  # a piece: a copy only if not already in place


def _receive(target: Tensor, like: Tensor, source: int, device: torch.device) -> None:
    """One shard from rank ``source`` into ``target``, piece by piece: in place when it can, else via a piece buffer."""
    for rows in _row_steps(like):
        part = target[rows]
        if device.type == "cpu" and part.is_contiguous() and part.dtype == like.dtype:
            dist.recv(part, source)
            continue
        buffer = torch.empty(like[rows].shape, dtype=like.dtype, device=device)
        dist.recv(buffer, source)
        part.copy_(buffer)
        del buffer


def _shapes(pieces: list[dict[str, Shards]], key: str, cfg: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of the weight ``key`` and of every state key any rank holds."""
    found: dict[str, tuple[int, ...]] = {key: (cfg.num_embeddings, cfg.embedding_dim)}
    for rank_pieces in pieces:  # state keys that live only on other ranks
        for name, shards in rank_pieces.items():
            if name != key and shards:
                if name.rsplit("/", 1)[1] == "step":
                    found.setdefault(name, (1,))
                else:
                    rest = (cfg.embedding_dim,) if shards[0][1].dim() == 2 else ()
                    found.setdefault(name, (cfg.num_embeddings, *rest))
    return found


def _streamed(local: dict[str, Shards], dst: int, key: str, cfg: Any) -> Iterator[tuple[str, Tensor]]:
    """Collective: one table's full tensors on rank ``dst``, one at a time (nothing elsewhere).

    Only shapes travel as objects; every rank sends its pieces in sorted key order, the order in
    which rank ``dst`` fills the tensors. Full tensors are fp32, like the unsharded module's.
    """
    described = {k: [(o, torch.empty(t.shape, dtype=t.dtype, device="meta")) for o, t in v] for k, v in local.items()}
    metas = _gather(described, dst)
    device = _comm_device()
    if dist.get_rank() != dst:
        for name in sorted(local):
            _send(local[name], dst, device)
        return
    shapes = _shapes(metas, key, cfg)
    for name in sorted(shapes):
        full = torch.empty(shapes[name])  # pages become resident as pieces land
        for source, described_pieces in enumerate(metas):
            for i, (offsets, like) in enumerate(described_pieces.get(name, [])):
                target = _target(full, offsets, like)
                if source == dst:
                    target.copy_(local[name][i][1])
                else:
                    _receive(target, like, source, device)
                del target
        yield name, full
        del full  # not held while the next one is gathered


def _collected(local: dict[str, Shards], dst: int | None, key: str, cfg: Any) -> Iterator[tuple[str, Tensor]]:
    """One table's full tensors from every rank's pieces sent as objects (one process, or ``dst=None``)."""
    pieces = _gather({k: [(o, t.cpu()) for o, t in v] for k, v in local.items()}, dst)
    shapes = _shapes(pieces, key, cfg)
    for name in sorted(shapes):
        full = torch.empty(shapes[name])
        for rank_pieces in pieces:
            for offsets, t in rank_pieces.pop(name, []):
                _target(full, offsets, t).copy_(t)
        yield name, full
        del full


def iter_full_state(sharded: Mapping[str, ShardedCollection], dst: int | None = None) -> Iterator[FullTensor]:
    """Collective: each table's full weight, then each of its fused optimizer states, one tensor at a time.

    Yields :data:`FullTensor` entries in host memory on rank ``dst`` (nothing on the other ranks;
    ``dst=None``: on every rank), then each dynamic table's id-mapping buffers. With a process
    group and ``dst`` set, each tensor is gathered only when asked for, so a caller that drops
    each one before the next holds one full tensor at a time. Every rank must exhaust the iterator.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    streamed = dst is not None and dist.is_initialized() and dist.get_world_size() > 1
    for path, module in sharded.items():
        local_weights, local_states = module.local_shards(), module.local_states()
        for cfg in module.table_configs():  # every rank: every table, the same order
            key = state_key(module, path, cfg.name)
            mine: Shards = [
                ((m.shard_offsets[0], m.shard_offsets[1]), w.detach()) for m, w in local_weights.get(cfg.name, [])
            ]
            local = {key: mine, **_table_states(key, local_states.get(cfg.name, []))}
            if streamed and dst is not None:
                tensors = _streamed(local, dst, key, cfg)
            else:
                tensors = _collected(local, dst, key, cfg)
            for name, full in tensors:
                if name == key:
                    yield key, None, full
                else:
                    weight_key, state = name.rsplit("/", 1)
                    yield weight_key, state, full.reshape(()) if state == "step" else full
                del full  # not held while the next one is gathered
            del mine, local
        mappers = local_mappers(module)
        for cfg in dynamic_configs(module):  # the id mapping: global tensors, like the unsharded module's
            layout, prefix = DynamicLayout.of(cfg), mapper_prefix(path, cfg.name)
            chunks = _gather(mapper_chunks(layout, prefix, mappers.get(cfg.name)), dst)
            if dst is None or rank == dst:
                for buffer_key, t in assemble(layout, prefix, chunks).items():
                    yield buffer_key, None, t
            del chunks


def gather_full_state(
    sharded: Mapping[str, ShardedCollection], dst: int | None = None
) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    """Collective: every table's full weight and full fused optimizer state, all at once, in host memory.

    :func:`iter_full_state` collected: ``(weights by key, states by weight key then name)``; rank
    ``dst`` ends up holding every table (``dst=None``: every rank, for tests and small models);
    ranks other than ``dst`` return empty dicts.
    """
    weights: dict[str, Tensor] = {}
    nested: dict[str, dict[str, Tensor]] = {}
    for key, state, t in iter_full_state(sharded, dst):
        if state is None:
            weights[key] = t
        else:
            nested.setdefault(key, {})[state] = t
    return weights, nested


def _table_states(key: str, shards: list[tuple[Any, dict[str, Tensor]]]) -> dict[str, Shards]:
    """This rank's fused state of one table where it lies, keyed ``<weight key>/<state>[@<first column>]``."""
    states: dict[str, Shards] = {}
    for meta, state in shards:
        for name, t in state.items():
            full = f"{key}/{name}"
            if t.dim() == 1:  # one value per row *of this column piece*: keyed by its first column
                full = f"{full}@{meta.shard_offsets[1]}"
            if t.dim() == 0:  # a step counter, the same for every shard
                states[full] = [((0, 0), t.detach().reshape(1))]
                continue
            states.setdefault(full, []).append((meta.shard_offsets, t.detach()))
    return states
