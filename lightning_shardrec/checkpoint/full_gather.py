"""Full tensors of sharded tables gathered on one rank in bands of rows (a full-format save).

:class:`FullGather` first gathers the shapes of every rank's pieces (a few bytes each), so rank
``dst`` knows every full tensor (each table's weight, each of its fused optimizer states) before
any values travel; then :meth:`FullGather.bands` gathers each tensor's rows in bands of at most
:data:`~lightning_shardrec.checkpoint.sharded_state.PIECE_BYTES`: every rank sends the rows of
its shards that fall in the band and rank ``dst`` receives them into their place in one reused
band buffer. A writer that puts each band into its reserved place in the file
(:meth:`~lightning_shardrec.checkpoint.StreamedFile.fill`) makes rank ``dst`` hold its share and
one band; the other ranks hold their share (pieces are sent from where they lie).

:func:`iter_full_state` puts the bands together into whole tensors, one at a time (``dst=None``:
everything on every rank as objects, ``all_gather_object``; for tests and small models).
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


def _send(piece: Tensor, dst: int, device: torch.device) -> None:
    dist.send(piece.to(device).contiguous(), dst)  # a copy only if not already in place


def _receive(target: Tensor, like: Tensor, source: int, device: torch.device) -> None:
    """One piece from rank ``source`` into ``target``: in place when it can, else via a piece-sized buffer."""
    if device.type == "cpu" and target.is_contiguous() and target.dtype == like.dtype:
        dist.recv(target, source)
        return
    buffer = torch.empty(like.shape, dtype=like.dtype, device=device)
    dist.recv(buffer, source)
    target.copy_(buffer)


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


def _row_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def _bands(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """A full fp32 tensor's rows ``[a, b)`` in bands of at most ``PIECE_BYTES`` (one row at least)."""
    step = max(1, sharded_state.PIECE_BYTES // (4 * _row_numel(shape)))
    return [(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]


def _overlap(band: tuple[int, int], offsets: tuple[int, int], like: Tensor) -> tuple[int, int] | None:
    """The rows of a shard at ``offsets`` (shaped like ``like``) that fall in ``band``, from the shard's first row."""
    lo, hi = max(band[0], offsets[0]), min(band[1], offsets[0] + like.shape[0])
    return (lo - offsets[0], hi - offsets[0]) if lo < hi else None


def _split(name: str, key: str) -> tuple[str, str | None]:
    """``(weight key, state)`` of a gathered name (``<weight key>`` or ``<weight key>/<state>``)."""
    if name == key:
        return key, None
    weight_key, state = name.rsplit("/", 1)
    return weight_key, state


class FullGather:
    """Collective: every table's full tensors on rank ``dst``, shapes first, then their rows in bands.

    Constructing it gathers every rank's pieces' shapes (objects of a few bytes per piece) and the
    dynamic tables' id mappings (:attr:`mappings`, global tensors by key); rank ``dst`` then knows
    :attr:`tensors`, every full tensor as ``(weight key, state, shape)`` (``state`` None for the
    weight; a step counter has shape ``()``), in the order :meth:`bands` fills them. Nothing is
    gathered on the other ranks (empty lists). Full tensors are fp32, like the unsharded module's.
    """

    def __init__(self, sharded: Mapping[str, ShardedCollection], dst: int) -> None:
        self.dst = dst
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._local: list[tuple[str, Any, dict[str, Shards]]] = []
        for path, module in sharded.items():
            local_weights, local_states = module.local_shards(), module.local_states()
            for cfg in module.table_configs():  # every rank: every table, the same order
                key = state_key(module, path, cfg.name)
                mine: Shards = [
                    ((m.shard_offsets[0], m.shard_offsets[1]), w.detach()) for m, w in local_weights.get(cfg.name, [])
                ]
                self._local.append((key, cfg, {key: mine, **_table_states(key, local_states.get(cfg.name, []))}))
        described = [
            {k: [(o, torch.empty(t.shape, dtype=t.dtype, device="meta")) for o, t in v] for k, v in local.items()}
            for _, _, local in self._local
        ]
        metas = _gather({"tables": described}, dst)
        #: on rank ``dst``: per full tensor, its table's index, gathered name, shape and every rank's pieces of it
        self._plan: list[tuple[int, str, tuple[int, ...], list[list[tuple[tuple[int, int], Tensor]]]]] = []
        self.tensors: list[tuple[str, str | None, tuple[int, ...]]] = []
        for i, (key, cfg, _) in enumerate(self._local if self.rank == dst else []):
            per_rank = [m["tables"][i] for m in metas]
            for name, shape in sorted(_shapes(per_rank, key, cfg).items()):
                weight_key, state = _split(name, key)
                self._plan.append((i, name, shape, [pieces.get(name, []) for pieces in per_rank]))
                self.tensors.append((weight_key, state, () if state == "step" else shape))
        self.mappings: dict[str, Tensor] = {}
        for path, module in sharded.items():
            mappers = local_mappers(module)
            for cfg in dynamic_configs(module):  # the id mapping: global tensors, like the unsharded module's
                layout, prefix = DynamicLayout.of(cfg), mapper_prefix(path, cfg.name)
                chunks = _gather(mapper_chunks(layout, prefix, mappers.get(cfg.name)), dst)
                if self.rank == dst:
                    self.mappings.update(assemble(layout, prefix, chunks))

    def bands(self) -> Iterator[tuple[int, int, Tensor]]:
        """Collective: ``(index into tensors, first element, rows)``, each band at most ``PIECE_BYTES``, in order.

        Every rank sends the rows of its shards that fall in each band, band by band, and rank
        ``dst`` receives them into their place in the band (other ranks yield nothing). The bands
        share one buffer: use (write, copy) each before asking for the next. Every rank must
        exhaust the iterator.
        """
        device = _comm_device() if dist.is_initialized() else torch.device("cpu")
        if self.rank != self.dst:
            for key, cfg, local in self._local:
                for name, shape in sorted(_shapes([local], key, cfg).items()):
                    for band in _bands(shape):
                        for offsets, t in local[name]:
                            overlap = _overlap(band, offsets, t)
                            if overlap is not None:
                                _send(t[overlap[0] : overlap[1]], self.dst, device)
            return
        sizes = [(b - a) * _row_numel(shape) for _, _, shape, _ in self._plan for a, b in _bands(shape)]
        buffer = torch.empty(max(sizes, default=0))  # one band's room, reused: no allocator churn per band
        for index, (table, name, shape, per_rank) in enumerate(self._plan):
            for band in _bands(shape):
                rows = buffer[: (band[1] - band[0]) * _row_numel(shape)].view(band[1] - band[0], *shape[1:])
                for source, pieces in enumerate(per_rank):
                    for i, (offsets, like) in enumerate(pieces):
                        overlap = _overlap(band, offsets, like)
                        if overlap is None:
                            continue
                        part = like[overlap[0] : overlap[1]]
                        at = (overlap[0] + offsets[0] - band[0], offsets[1])
                        target = _target(rows, at, part)
                        if source == self.dst:
                            target.copy_(self._local[table][2][name][i][1][overlap[0] : overlap[1]])
                        else:
                            _receive(target, part, source, device)
                        del target
                yield index, band[0] * _row_numel(shape), rows
                del rows


def iter_full_state(sharded: Mapping[str, ShardedCollection], dst: int | None = None) -> Iterator[FullTensor]:
    """Collective: each table's full weight, then each of its fused optimizer states, one tensor at a time.

    Yields :data:`FullTensor` entries in host memory on rank ``dst`` (nothing on the other ranks;
    ``dst=None``: on every rank), then each dynamic table's id-mapping buffers. With ``dst`` set,
    each tensor is put together from :meth:`FullGather.bands` only when asked for, so a caller
    that drops each one before the next holds one full tensor and one band at a time. Every rank
    must exhaust the iterator.
    """
    if dst is not None:
        yield from _assembled(FullGather(sharded, dst))
        return
    for path, module in sharded.items():
        local_weights, local_states = module.local_shards(), module.local_states()
        for cfg in module.table_configs():  # the same order as FullGather's
            key = state_key(module, path, cfg.name)
            mine: Shards = [
                ((m.shard_offsets[0], m.shard_offsets[1]), w.detach()) for m, w in local_weights.get(cfg.name, [])
            ]
            local: dict[str, Shards] = {key: mine, **_table_states(key, local_states.get(cfg.name, []))}
            pieces = _gather({k: [(o, t.cpu()) for o, t in v] for k, v in local.items()}, dst)
            for name, shape in sorted(_shapes(pieces, key, cfg).items()):
                full = torch.empty(shape)
                for rank_pieces in pieces:
                    for offsets, t in rank_pieces.pop(name, []):
                        _target(full, offsets, t).copy_(t)
                weight_key, state = _split(name, key)
                yield weight_key, state, full.reshape(()) if state == "step" else full
                del full
            del mine, local, pieces
        mappers = local_mappers(module)
        for cfg in dynamic_configs(module):
            layout, prefix = DynamicLayout.of(cfg), mapper_prefix(path, cfg.name)
            chunks = _gather(mapper_chunks(layout, prefix, mappers.get(cfg.name)), dst)
            for buffer_key, t in assemble(layout, prefix, chunks).items():
                yield buffer_key, None, t
            del chunks


def _assembled(gather: FullGather) -> Iterator[FullTensor]:
    """:meth:`FullGather.bands` put together into whole tensors, one at a time (nothing off rank ``dst``)."""
    full, current = torch.empty(0), -1
    for index, first, rows in gather.bands():
        if index != current:
            if current >= 0:
                yield gather.tensors[current][0], gather.tensors[current][1], full
            full, current = torch.empty(gather.tensors[index][2]), index
        full.view(-1)[first : first + rows.numel()] = rows.reshape(-1)
        del rows
    if current >= 0:
        yield gather.tensors[current][0], gather.tensors[current][1], full
    del full
    yield from ((k, None, t) for k, t in gather.mappings.items())


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
