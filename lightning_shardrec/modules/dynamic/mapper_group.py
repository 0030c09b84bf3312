"""Several dynamic tables mapped in one pass: a fixed op sequence for all of them.

The id -> slot mapping of one table is some hundred small tensor ops; on CPU each
costs ~10 us whatever its size, so eight tables mapped one by one spend most of their
time in fixed costs. Buckets never interact, so the buckets of tables that share a
slot layout and policy (:func:`fuse_key`) can be laid end to end and mapped as one
table (:mod:`~lightning_shardrec.modules.dynamic.slots`), each table keeping its own
step. The result is, bucket by bucket, what mapping each table alone gives::

    tables t0 (4 local buckets), t1 (2)   ->   flat buckets [t0: 0 1 2 3][t1: 4 5]
    id 42 of t1 -> bucket 1 of t1         ->   flat bucket 5, flat slot 5 * S + j

The tables' :class:`~lightning_shardrec.modules.DynamicIdMapper` modules keep their
buffers (state dicts, checkpoints and ``.to()`` see nothing new): the group makes them
views of one flat tensor per buffer, and makes them again whenever a buffer was
replaced (``.to()``, ``load_state_dict(assign=True)``), so a stale binding is never used.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightning_shardrec.modules.dynamic.admission import lookup_slots_fixed
from lightning_shardrec.modules.dynamic.layout import BUFFERS
from lightning_shardrec.modules.dynamic.mapper import (
    WINDOW_BITS_PER_SLOT,
    WINDOW_BUFFERS,
    DynamicIdMapper,
    record_window,
)
from lightning_shardrec.modules.dynamic.slots import (
    BucketRanges,
    SlotState,
    expire,
    locate,
    lookup_slots,
    uses_compiled_loops,
)


def fuse_key(mapper: DynamicIdMapper) -> Hashable:
    """Mappers with equal keys can be mapped together: same slots and candidates per bucket, same policy."""
    c = mapper.config
    return (mapper.slots_per_bucket, mapper.cands_per_bucket, c.eviction, c.min_count, c.ttl_steps)


@dataclass(frozen=True)
class GroupLookup:
    """One lookup of a group's tables, ``N`` ids in all.

    ``rows [N]``: each id's row in its mapper's block (``slot - row_offset``; ``-1``:
    missed). ``new_tables``, ``new_rows``, ``new_generations [M]``: the rows (re)assigned
    this step, by mapper index, to be reset before use; ``new_counts``: how many each
    mapper has, when the lookup read it anyway (else None).
    """

    rows: Tensor
    new_tables: Tensor
    new_rows: Tensor
    new_generations: Tensor
    new_counts: list[int] | None = None


class MapperGroup:
    """Mappers of one :func:`fuse_key`, mapped together (:meth:`map`)."""

    def __init__(self, mappers: Sequence[DynamicIdMapper], *, routed: bool = False) -> None:
        """``routed``: ids come from the input distribution, sent here by their bucket (see ``BucketRanges``)."""
        keys = {fuse_key(m) for m in mappers}
        if not mappers or len(keys) != 1:  # internal: callers group by fuse_key
            raise ValueError(f"a mapper group needs one slot layout and policy, got {sorted(map(str, keys))}")
        self.mappers = list(mappers)
        self.width = mappers[0].slots_per_bucket
        self.routed = routed
        self._views: list[dict[str, Tensor]] = []
        self._flat: dict[str, Tensor] = {}
        self._ranges: BucketRanges | None = None
        self._entries: tuple[Tensor, Tensor] | None = None  # slots, candidates per table (for expiry)

    # --- binding ------------------------------------------------------------------
    def _bound(self) -> bool:
        pairs = zip(self.mappers, self._views, strict=True)
        names = (*BUFFERS, *WINDOW_BUFFERS)
        return bool(self._views) and all(m._buffers[name] is view[name] for m, view in pairs for name in names)

    def _bind(self) -> None:
        """Make every mapper's buffers views of one flat tensor per buffer (copying their values in)."""
        views: list[dict[str, Tensor]] = [{} for _ in self.mappers]
        for name in (*BUFFERS, *WINDOW_BUFFERS):
            parts = [m._buffers[name] for m in self.mappers]
            assert all(p is not None for p in parts)  # internal: every mapper registers every buffer
            flat = torch.stack(parts) if name == "step" else torch.cat(parts)  # type: ignore[arg-type]
            start = 0
            for i, (m, part) in enumerate(zip(self.mappers, parts, strict=True)):
                assert part is not None
                view = flat[i] if name == "step" else flat[start : start + part.shape[0]]
                start += 0 if name == "step" else part.shape[0]
                m._buffers[name] = views[i][name] = view
            self._flat[name] = flat
        self._views = views
        tables = [(m.table, m.num_buckets, m.bucket_lo, m.bucket_hi) for m in self.mappers]
        self._ranges = replace(BucketRanges.of(tables, self._flat["step"].device), routed=self.routed)
        self._entries = (self._ranges.count * self.width, self._ranges.count * self.mappers[0].cands_per_bucket)

    def state(self) -> SlotState:
        """The flat state of every mapper's buckets (binding them first if needed)."""
        if not self._bound():
            self._bind()
        m = self.mappers[0]
        return SlotState.of(self._flat, self.width, m.cands_per_bucket, m.config)

    # --- lookup -------------------------------------------------------------------
    def map(self, ids: Tensor, counts: Sequence[int], train: bool) -> GroupLookup:
        """:meth:`lookup` at the tables' own steps, which a training lookup advances (tables with no ids too)."""
        self.state()  # binds: the steps below are the flat tensor
        result = self.lookup(ids, counts, self._flat["step"], train)
        if train:
            self._flat["step"] += 1
        return result

    @torch.no_grad()
    def lookup(self, ids: Tensor, counts: Sequence[int], steps: Tensor, train: bool) -> GroupLookup:
        """Map raw ids ``[N]``, the first ``counts[0]`` of mapper 0, then ``counts[1]`` of mapper 1, ...,
        mapper ``t`` at step ``steps[t]``."""
        state = self.state()
        ranges, entries = self._ranges, self._entries
        assert ranges is not None and entries is not None  # made by state()
        ids = ids.reshape(-1).to(device=state.slot_ids.device, dtype=torch.int64).contiguous()
        if train and state.config.ttl_steps is not None:
            slot_steps = torch.repeat_interleave(steps, entries[0], output_size=state.slot_ids.numel())
            cand_steps = torch.repeat_interleave(steps, entries[1], output_size=state.cand_ids.numel())
            expire(state, slot_steps, cand_steps)
        n = ids.numel()
        device = ids.device
        sizes = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)  # no sync: a queued copy
        table = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes, output_size=n)
        bucket, slot = locate(state, ranges, ids, table, steps, train)
        finish = lookup_slots if uses_compiled_loops(ids) else lookup_slots_fixed
        found = finish(state, ids, bucket, slot, table, steps, train)
        if train:
            bits = WINDOW_BITS_PER_SLOT * self.width
            nb = ranges.num_buckets.index_select(0, table)
            record_window(self._flat["window"], self._flat["window_ids"], bits, ids, bucket, nb, table, found.slots < 0)
        row_start = ranges.start * self.width
        rows = torch.where(found.slots >= 0, found.slots - row_start.index_select(0, table), -1)
        new_tables = torch.searchsorted(row_start, found.new, right=True) - 1
        new_rows = found.new - row_start.index_select(0, new_tables)
        return GroupLookup(rows, new_tables, new_rows, state.slot_gen[found.new], found.new_per_table)
