"""Full tensors of sharded tables gathered on one rank in bands of rows (a full-format save).

:class:`FullGather` describes every rank's pieces (:class:`~lightning_shardrec.distributed.comm.band_gather.BandGather`:
small int64 tensors, no pickles), so rank ``dst`` knows every full tensor (each table's weight,
each of its fused optimizer states) before any values travel; then :meth:`FullGather.bands`
gathers each tensor's rows in bands of at most
:data:`~lightning_shardrec.checkpoint.sharded_state.PIECE_BYTES`: every rank sends the rows of
its shards that fall in the band (non-blocking, all ranks at once) and rank ``dst`` receives them
into their place in one reused band buffer. A writer that puts each band into its reserved place
in the file (:meth:`~lightning_shardrec.checkpoint.StreamedFile.fill`) makes rank ``dst`` hold its
share and one band; the other ranks hold their share (pieces are sent from where they lie).

:func:`iter_full_state` puts the bands together into whole tensors, one at a time (``dst=None``:
on every rank, rank 0 gathering each band and broadcasting it; for tests and small models).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec.checkpoint import sharded_state
from lightning_shardrec.checkpoint.dynamic_state import DynamicLayout, dynamic_configs, local_mappers, mapper_prefix
from lightning_shardrec.distributed.comm.band_gather import BandGather, LocalTensor
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.modules.dynamic.layout import BUFFERS

Shards = list[tuple[tuple[int, int], Tensor]]

FullTensor = tuple[str, str | None, Tensor]
"""``(weight key, state, tensor)``: a table's full weight (``state`` None), one of its fused optimizer
states by name (``sum``, ``exp_avg``, ``sum@<first column>`` for a per-row state, ``step`` as a
scalar), or a dynamic table's id-mapping buffer (its own key, ``state`` None)."""


def state_key(module: ShardedCollection, path: str, table: str) -> str:
    """``table``'s weight key in the unsharded model's state dict."""
    name = module.state_key(table)
    return f"{path}.{name}" if path else name


def _shape(name: str, key: str, cfg: Any, like: Tensor | None) -> tuple[int, ...]:
    """Full shape of the weight ``key`` or of one of its state keys (a piece of it shaped ``like``)."""
    if name == key:
        return (cfg.num_embeddings, cfg.embedding_dim)
    if name.rsplit("/", 1)[1] == "step":
        return (1,)
    return (cfg.num_embeddings, cfg.embedding_dim) if like is not None and like.dim() == 2 else (cfg.num_embeddings,)


def _split(name: str, key: str) -> tuple[str, str | None]:
    """``(weight key, state)`` of a gathered name (``<weight key>`` or ``<weight key>/<state>``)."""
    if name == key:
        return key, None
    weight_key, state = name.rsplit("/", 1)
    return weight_key, state


def _tables(sharded: Mapping[str, ShardedCollection], groups: Iterator[int], keys: dict[int, str]) -> list[LocalTensor]:
    """This rank's pieces of every table's weight and fused states (fp32 full tensors), a group per table.

    ``keys`` receives each table's weight key by its group.
    """
    out: list[LocalTensor] = []
    for path, module in sharded.items():
        local_weights, local_states = module.local_shards(), module.local_states()
        for cfg in module.table_configs():  # every rank: every table, the same order
            group, key = next(groups), state_key(module, path, cfg.name)
            keys[group] = key
            mine: Shards = [((m.shard_offsets[0], m.shard_offsets[1]), w) for m, w in local_weights.get(cfg.name, [])]
            for name, pieces in {key: mine, **_table_states(key, local_states.get(cfg.name, []))}.items():
                shape = _shape(name, key, cfg, pieces[0][1] if pieces else None)
                out.append(LocalTensor(group=group, name=name, shape=shape, dtype=torch.float32, pieces=pieces))
    return out


def _mappings(path: str, module: ShardedCollection, groups: Iterator[int]) -> list[LocalTensor]:
    """This rank's chunks of the collection's dynamic tables' id mappings (int64 global tensors)."""
    out: list[LocalTensor] = []
    mappers = local_mappers(module)
    for cfg in dynamic_configs(module):
        layout, prefix, mapper = DynamicLayout.of(cfg), mapper_prefix(path, cfg.name), mappers.get(cfg.name)
        group = next(groups)
        for name in BUFFERS:
            pieces: Shards = []
            if mapper is not None:
                offsets, _ = layout.chunk(name, mapper.bucket_lo, mapper.bucket_hi)
                buffer = getattr(mapper, name)
                first = (*offsets, 0, 0)
                pieces = [((first[0], first[1]), buffer.reshape(1) if buffer.dim() == 0 else buffer)]
            shape = layout.size(name) or (1,)
            out.append(LocalTensor(group=group, name=prefix + name, shape=shape, dtype=torch.int64, pieces=pieces))
    return out


class FullGather:
    """Collective: every table's full tensors on rank ``dst``, descriptions first, then their rows in bands.

    Constructing it describes every rank's pieces and gathers the dynamic tables' id mappings
    (:attr:`mappings`, global tensors by key, on rank ``dst``); rank ``dst`` then knows
    :attr:`tensors`, every full tensor as ``(weight key, state, shape)`` (``state`` None for the
    weight; a step counter has shape ``()``), in the order :meth:`bands` fills them. Nothing is
    gathered on the other ranks (empty lists). Full tensors are fp32, like the unsharded module's.
    """

    def __init__(self, sharded: Mapping[str, ShardedCollection], dst: int) -> None:
        self.dst = dst
        groups, keys = iter(range(2**62)), dict[int, str]()
        self._gather = BandGather(_tables(sharded, groups, keys), dst, band_bytes=sharded_state.PIECE_BYTES)
        self.tensors: list[tuple[str, str | None, tuple[int, ...]]] = []
        for layout in self._gather.layouts:
            weight_key, state = _split(layout.name, keys[layout.group])
            self.tensors.append((weight_key, state, () if state == "step" else layout.shape))
        mappings = [t for path, module in sharded.items() for t in _mappings(path, module, groups)]
        gathered = BandGather(mappings, dst, band_bytes=sharded_state.PIECE_BYTES)
        self.mappings: dict[str, Tensor] = {
            layout.name: full.reshape(()) if _is_step(layout.name) else full for layout, full in gathered.whole()
        }

    def bands(self) -> Iterator[tuple[int, int, Tensor]]:
        """Collective: ``(index into tensors, first element, rows)``, each band at most ``PIECE_BYTES``, in order.

        Every rank sends the rows of its shards that fall in each band, band by band, and rank
        ``dst`` receives them into their place in the band (other ranks yield nothing). The bands
        share one buffer: use (write, copy) each before asking for the next. Every rank must
        exhaust the iterator.
        """
        return self._gather.bands()


def _is_step(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == "step"


def iter_full_state(sharded: Mapping[str, ShardedCollection], dst: int | None = None) -> Iterator[FullTensor]:
    """Collective: each table's full weight, then each of its fused optimizer states, one tensor at a time.

    Yields :data:`FullTensor` entries in host memory on rank ``dst`` (nothing on the other ranks;
    ``dst=None``: on every rank), then each dynamic table's id-mapping buffers (``dst=None``:
    after each collection's tables). Each tensor is put together from bands only when asked
    for, so a caller that drops each one before the next holds one full tensor and one band at
    a time. Every rank must exhaust the iterator.
    """
    if dst is not None:
        gather = FullGather(sharded, dst)
        yield from _assembled(gather)
        return
    groups, local, keys = iter(range(2**62)), list[LocalTensor](), dict[int, str]()
    for path, module in sharded.items():  # a collection's tables, then its mappings
        local += _tables({path: module}, groups, keys)
        local += _mappings(path, module, groups)
    for layout, full in BandGather(local, None, band_bytes=sharded_state.PIECE_BYTES).whole():
        if layout.group in keys:
            key, state = _split(layout.name, keys[layout.group])
            yield key, state, full.reshape(()) if state == "step" else full
        else:
            yield layout.name, None, full.reshape(()) if _is_step(layout.name) else full
        del full


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
