"""Serving a dynamic table: its frozen raw id -> row mapping, looked up by bucket (vectorised).

A trained dynamic table (:mod:`lightning_shardrec.modules.dynamic.mapper`) maps raw int64
ids to slots with a mapper that admits and evicts. Serving needs only what the
unsharded module does in ``eval()``: a resident, unexpired id reads its row, any other
id reads zeros. :class:`QuantIdMap` freezes that as two buffers of the table's
capacity ``C = B * S`` (``B`` buckets of ``S`` slots), in slot order::

    ids   int64 [C]   the id each slot holds
    live  bool  [C]   whether it serves it (resident and not expired)

    S = 2, B = 2: slot   0     1   |  2     3          (slot 1 free, slot 3 expired)
                  ids  [-7,    0   | 42,    9 ]
                  live [True, False| True, False]

An id is looked up only in its own bucket ``bucket_of(id, B)`` (the training hash): it
is compared with the bucket's ``S`` held ids where the slot is live, and its match is
its row (the slot); without one it reads row ``C``. That is one gather of ``S``
contiguous int64 per id, no per-id Python and no search over the whole table. Row
``C`` of the quantized table is all zeros, so a missing id adds nothing to a SUM bag
and still counts in a MEAN bag's size, as in the training module. Fixed shapes keep
``load_state_dict`` strict.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import DynamicConfig
from lightning_shardrec.modules.dynamic.hashing import bucket_of
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper
from lightning_shardrec.modules.dynamic.native import native_loops
from lightning_shardrec.modules.dynamic.ops import serve

_CHUNK = 1 << 22  # elements of an [ids, S] gather done at once


def live_slots(mapper: DynamicIdMapper) -> tuple[Tensor, Tensor]:
    """``(ids [n], global slots [n])`` the mapper serves in eval: resident and not expired."""
    live = mapper.slot_step >= 0
    ttl = mapper.config.ttl_steps
    if ttl is not None:
        live &= mapper.step - mapper.slot_step <= ttl
    local = live.nonzero().squeeze(1)
    return mapper.slot_ids[local], local + mapper.row_offset


class QuantIdMap(nn.Module):
    """Raw int64 ids -> rows of one dynamic table, ``C`` (the zero row) where an id is not live."""

    ids: Tensor
    live: Tensor

    def __init__(self, table: str, config: DynamicConfig, capacity: int, device: torch.device | str | None = None):
        super().__init__()
        self.capacity = capacity
        self.num_buckets, self.slots_per_bucket = config.layout(capacity, table)
        self.register_buffer("ids", torch.zeros(capacity, dtype=torch.int64, device=device))
        self.register_buffer("live", torch.zeros(capacity, dtype=torch.bool, device=device))

    @torch.no_grad()
    def set_live(self, ids: Tensor, slots: Tensor) -> None:
        """Serve ``ids [n]`` from their ``slots [n]`` (slot ``s`` in bucket ``s // S``, as the
        mapper placed them); every other id reads row ``C``."""
        if ids.shape != slots.shape or ids.dim() != 1:
            raise ValueError(f"QuantIdMap: ids {tuple(ids.shape)} and slots {tuple(slots.shape)} must be [n] each")
        slots = slots.to(self.ids.device, torch.int64)
        if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < self.capacity:
            raise ValueError(f"QuantIdMap: slots must be in [0, {self.capacity}), got {slots.min()}..{slots.max()}")
        self.ids.zero_()
        self.live.zero_()
        self.ids[slots] = ids.to(self.ids.device, torch.int64)
        self.live[slots] = True

    def live_rows(self) -> Tensor:
        """The rows some id reads (``[n]``)."""
        return self.live.nonzero().squeeze(1)

    def forward(self, ids: Tensor) -> Tensor:
        """Rows ``[N]`` int64 of raw ids ``[N]`` (any int64); ``C`` where the id is not live."""
        ids = ids.to(self.ids.device, torch.int64).contiguous()
        width = self.slots_per_bucket
        loops = native_loops() if ids.device.type == "cpu" else None
        if loops is not None and self.ids.is_contiguous() and self.live.is_contiguous():  # the same, compiled
            return serve(ids, self.num_buckets, width, self.ids, self.live, self.capacity)
        held_all, live_all = self.ids.view(-1, width), self.live.view(-1, width)
        out = torch.empty_like(ids)
        step = max(1, _CHUNK // width)
        for start in range(0, ids.numel(), step):  # chunks bound memory, not a per-id loop
            part = ids[start : start + step]
            bucket = bucket_of(part, self.num_buckets)
            match = (held_all.index_select(0, bucket) == part.unsqueeze(1)) & live_all.index_select(0, bucket)
            first = match.view(torch.uint8).argmax(dim=1, keepdim=True)  # the match (0 if none)
            hit = match.gather(1, first).squeeze(1)
            out[start : start + step] = torch.where(hit, bucket * width + first.squeeze(1), self.capacity)
        return out


def sorted_live(id_map: QuantIdMap) -> tuple[Tensor, Tensor]:
    """``(keys [n], rows [n])``: the live ids in ascending order and the row each reads.

    The tensor-op form of the same frozen map, for :func:`lookup_sorted` (``torch.export``
    traces it; the bucket loop above is a compiled CPU loop it cannot). With no live id
    the pair is one entry that reads the zero row ``C``, so the lookup needs no branch.
    """
    rows = id_map.live_rows()
    keys = id_map.ids[rows]
    if keys.numel() == 0:
        return keys.new_zeros(1), rows.new_full((1,), id_map.capacity)
    keys, order = torch.sort(keys)
    return keys, rows[order]


def lookup_sorted(keys: Tensor, rows: Tensor, ids: Tensor, capacity: int) -> Tensor:
    """Rows ``[N]`` of raw ids ``[N]`` by binary search in ``keys`` (from :func:`sorted_live`);
    ``capacity`` (the zero row) where an id is not live: equal to ``QuantIdMap.forward``."""
    ids = ids.to(torch.int64)
    pos = torch.searchsorted(keys, ids).clamp_(max=keys.numel() - 1)
    return torch.where(keys[pos] == ids, rows[pos], capacity)
