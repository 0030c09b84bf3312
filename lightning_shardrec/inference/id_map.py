"""Serving a dynamic table: a frozen raw id -> row mapping, looked up with ``searchsorted``.

A trained dynamic table (:mod:`lightning_shardrec.modules.dynamic_ids`) maps raw int64
ids to slots with a mapper that admits and evicts. Serving needs only what the
unsharded module does in ``eval()``: a resident, unexpired id reads its row, any other
id reads zeros. :class:`QuantIdMap` freezes that as two buffers of the table's
capacity ``C``::

    ids   int64 [C]   the live ids, sorted, then padding (int64 max)
    rows  int64 [C]   the row each live id reads; C (the all-zero row) for padding

    slot:   0    1    2    3          (C = 4; slot 1 free, slot 3 expired)
    held:   -7   .    42   9
    ids  = [-7, 42, max, max]   rows = [0, 2, 4, 4]

A lookup is ``p = searchsorted(ids, x)``; ``x`` hits when ``ids[p] == x`` and reads
``rows[p]``, else it reads row ``C``, which the quantized table keeps all zeros (so a
missing id adds nothing to a SUM bag and still counts in a MEAN bag's size, as in the
training module). Padding sorts last, so a live id equal to int64 max is found before
it; padding itself reads row ``C``. Fixed shapes keep ``load_state_dict`` strict.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_shardrec.modules.dynamic_ids import DynamicIdMapper

_PAD = torch.iinfo(torch.int64).max


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
    rows: Tensor

    def __init__(self, capacity: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.register_buffer("ids", torch.full((capacity,), _PAD, dtype=torch.int64, device=device))
        self.register_buffer("rows", torch.full((capacity,), capacity, dtype=torch.int64, device=device))

    @torch.no_grad()
    def set_live(self, ids: Tensor, rows: Tensor) -> None:
        """Serve ``ids [n]`` (unique) from ``rows [n]`` (in ``[0, C)``); every other id reads row ``C``."""
        n = ids.numel()
        if n > self.capacity or rows.numel() != n:
            raise ValueError(
                f"QuantIdMap: {n} ids and {rows.numel()} rows for a table of capacity {self.capacity} "
                "(need as many rows as ids, at most the capacity)"
            )
        order = torch.sort(ids.to(self.ids.device, torch.int64), stable=True)
        self.ids.fill_(_PAD)
        self.rows.fill_(self.capacity)
        self.ids[:n] = order.values
        self.rows[:n] = rows.to(self.rows.device, torch.int64)[order.indices]

    def live_rows(self) -> Tensor:
        """The rows some id reads (``[n]``)."""
        return self.rows[self.rows < self.capacity]

    def forward(self, ids: Tensor) -> Tensor:
        """Rows ``[N]`` int64 of raw ids ``[N]`` (any int64); ``C`` where the id is not live."""
        ids = ids.to(self.ids.device, torch.int64)
        pos = torch.searchsorted(self.ids, ids).clamp_(max=self.capacity - 1)
        return torch.where(self.ids[pos] == ids, self.rows[pos], self.capacity)
