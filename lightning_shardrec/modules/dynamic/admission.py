"""Training admission in fixed-size tensors: :func:`~.slots.lookup_slots` without host syncs.

:func:`~lightning_shardrec.modules.dynamic.slots.lookup_slots` compacts as it goes (the
misses, their unique ids, the ready ones, the new slots): each compaction is a
``nonzero`` or a boolean index, cheap on CPU but a host sync on a GPU (the host waits
to learn the size). Here every step keeps all ``N`` ids and carries a mask instead:
the missing ids sort ahead of the hits, so their unique pairs take the first positions
in the order the compacting code gives them, and the placement
(:func:`~lightning_shardrec.modules.dynamic.slots.place_fixed`) ranks the valid ones
exactly as it would alone. The results are the same bit for bit; the one host sync
left is the size of ``new`` (the rows reset this step), which the caller needs anyway.

Used wherever the compiled CPU loops are not (on a GPU, and on CPU where the package has no compiled loops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.configs import EvictionPolicy
from lightning_shardrec.modules.dynamic.slots import (
    SlotLookup,
    SlotState,
    Step,
    _table_steps,
    find,
    lookup_slots,
    place_fixed,
    put_where,
    sort_pairs,
)


def lookup_slots_fixed(
    state: SlotState, ids: Tensor, bucket: Tensor, slot: Tensor, table: Tensor | None, steps: Tensor, train: bool
) -> SlotLookup:
    """:func:`~lightning_shardrec.modules.dynamic.slots.lookup_slots` in ``[N]``-sized tensors: one host sync
    (the number of new slots of each table, kept in ``new_per_table``) per training lookup, none per eval lookup."""
    if not train or ids.numel() == 0:  # eval lookups compact nothing
        return lookup_slots(state, ids, bucket, slot, table, steps, train)
    miss = slot < 0
    ubucket, uniq, inverse, counts, valid = _unique_misses(bucket, ids, miss, state.slot_ids.numel() // state.width)
    utable = None if table is None else torch.zeros_like(ids).scatter_(0, inverse, table)
    got = _admit_fixed(state, uniq, ubucket, counts, _table_steps(steps, utable), valid)
    state.count("misses", ubucket, counts * (valid & (got < 0)))
    slot = torch.where(miss, got.index_select(0, inverse), slot)
    added = got >= 0
    per_table = torch.zeros_like(steps).index_add_(0, torch.zeros_like(got) if utable is None else utable, added.long())
    sizes = per_table.tolist()  # the one sync: how many rows each table (re)assigned
    first = torch.sort((~added).to(torch.uint8), stable=True).indices[: sum(sizes)]  # the added, in order
    return SlotLookup(slot, got.index_select(0, first), sizes)


def _unique_misses(
    bucket: Tensor, ids: Tensor, miss: Tensor, buckets: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Unique ``(bucket, id)`` pairs of the missing ids, sorted by bucket then id, padded to ``[N]``:
    ``(buckets, ids, inverse, counts, valid)``; ``valid`` marks the missing pairs (the first ones).

    Hits sort after every miss (their bucket key is shifted by ``buckets``), still apart
    by table; padding entries are bucket 0, id 0, count 0.
    """
    k, i, change, group, inverse = sort_pairs(torch.where(miss, bucket, bucket + buckets), ids)
    counts = torch.zeros_like(ids).index_add_(0, group, torch.ones_like(ids))
    ukey = torch.zeros_like(ids).scatter_(0, group, k)
    uniq = torch.zeros_like(ids).scatter_(0, group, i)
    valid = torch.zeros_like(change).scatter_(0, group, k < buckets)
    return torch.where(ukey >= buckets, ukey - buckets, ukey), uniq, inverse, counts, valid


def _admit_fixed(state: SlotState, ids: Tensor, bucket: Tensor, counts: Tensor, step: Step, valid: Tensor) -> Tensor:
    """Slots (flat, ``-1``: none) for the ``valid`` missing unique ids (the rules of
    :func:`~lightning_shardrec.modules.dynamic.slots.lookup_slots`' admission), in fixed-size ops."""
    total, has_cand, cand = counts, None, None
    if state.cands:
        cand = find(ids, bucket, state.cand_ids, state.cand_step, state.cands)
        has_cand = valid & (cand >= 0)
        total = counts + torch.where(has_cand, state.cand_count[cand.clamp(min=0)], 0)
    lfu = state.config.eviction is EvictionPolicy.LFU
    slots = (state.slot_ids, state.slot_step, state.slot_count)
    if cand is None:  # min_count 1: every missing id is ready, seen at most ``counts.sum()`` times
        most = (counts * valid).sum()
        got, entries, displaced = place_fixed(ids, bucket, total, step, slots, state.width, lfu, most, valid)
    else:
        ready = valid & (total >= state.config.min_count)
        got, entries, displaced = place_fixed(ids, bucket, total, step, slots, state.width, lfu, None, ready)
    admitted = got >= 0
    at = got.clamp(min=0)
    state.slot_gen.index_add_(0, at, admitted.long())
    state.count("admissions", at // state.width, admitted)
    state.count("evictions", entries // state.width, displaced)
    if cand is not None and has_cand is not None:
        held = cand.clamp(min=0)  # admitted: freed; not admitted: sightings kept at this step
        put_where(state.cand_step, held, torch.where(admitted, -1, step), has_cand)
        put_where(state.cand_count, held, torch.where(admitted, 0, total), has_cand)
        fresh = valid & ~admitted & ~has_cand
        table = (state.cand_ids, state.cand_step, state.cand_count)
        where, cand_entries, lost = place_fixed(ids, bucket, total, step, table, state.cands, False, None, fresh)
        state.count("dropped_candidates", cand_entries // state.cands, lost)
        state.count("dropped_candidates", bucket, fresh & (where < 0))
    return got
