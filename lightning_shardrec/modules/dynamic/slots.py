"""The vectorised id -> slot algorithm of dynamic tables, over flat bucket state.

:class:`SlotState` is the state of ``W`` buckets laid end to end: bucket ``b``'s slots
are entries ``[b * S, (b + 1) * S)`` of the slot buffers and its candidates entries
``[b * K, (b + 1) * K)`` of the candidate buffers. One :class:`DynamicIdMapper`'s
buffers are such a state, and so are the buffers of several mappers of the same
slot layout and policy concatenated (:class:`~lightning_shardrec.modules.dynamic.mapper_group.MapperGroup`):
buckets never interact, so one pass over many tables' buckets makes, bucket by
bucket, the choices one pass per table makes, with a fixed number of tensor ops
for all of them. The rules are :mod:`~lightning_shardrec.modules.dynamic.mapper`'.

Each table keeps its own step, so a step is passed as a scalar shared by every id
(one table) or as one step per id (several tables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_shardrec._compat.torch import assert_async
from lightning_shardrec.configs import DynamicConfig, EvictionPolicy
from lightning_shardrec.modules.dynamic import ops
from lightning_shardrec.modules.dynamic.hashing import bucket_of
from lightning_shardrec.modules.dynamic.native import native_loops

COUNTERS = ("admissions", "evictions", "expirations", "misses", "dropped_candidates")
_INT64_MAX = torch.iinfo(torch.int64).max
_CHUNK = 1 << 22  # elements of an [ids, slots] comparison done at once

Step = int | Tensor
"""A step: an int or a 0-d tensor shared by all, or a tensor of one step per element."""


@dataclass
class SlotState:
    """Flat state of ``W`` buckets (buffers of :class:`~lightning_shardrec.modules.DynamicIdMapper`'s names)."""

    slot_ids: Tensor  # [W * S]
    slot_step: Tensor
    slot_count: Tensor
    slot_gen: Tensor
    cand_ids: Tensor  # [W * K]
    cand_step: Tensor
    cand_count: Tensor
    counters: Tensor  # [W, len(COUNTERS)]
    width: int  # S
    cands: int  # K
    config: DynamicConfig

    @classmethod
    def of(cls, buffers: Mapping[str, Tensor], width: int, cands: int, config: DynamicConfig) -> SlotState:
        """From tensors named as :class:`~lightning_shardrec.modules.DynamicIdMapper`'s buffers."""
        b = buffers
        slots = (b["slot_ids"], b["slot_step"], b["slot_count"], b["slot_gen"])
        return cls(*slots, b["cand_ids"], b["cand_step"], b["cand_count"], b["counters"], width, cands, config)

    def count(self, name: str, bucket: Tensor, amount: Tensor | None = None) -> None:
        """Add ``amount [N]`` (default: 1 each) to counter ``name`` of buckets ``bucket [N]``."""
        col = torch.full_like(bucket, COUNTERS.index(name))
        value = torch.ones_like(bucket) if amount is None else amount.long()
        self.counters.index_put_((bucket, col), value, accumulate=True)


@dataclass(frozen=True)
class BucketRanges:
    """Which buckets each of ``T`` tables has in a :class:`SlotState`, as ``[T]`` int64 tensors.

    Table ``t``'s ids hash into ``num_buckets[t]`` buckets; the state holds its buckets
    ``[lo[t], lo[t] + count[t])`` as flat buckets from ``start[t]`` on. ``names`` and
    ``partial`` (some table has only part of its buckets) serve the range check; ``routed``: the
    ids were sent here by their bucket (the sharded path), so the check is a device-side assert
    (no host sync), not a read of the ids.
    """

    num_buckets: Tensor
    lo: Tensor
    count: Tensor
    start: Tensor
    names: list[str]
    partial: bool
    routed: bool = False

    @classmethod
    def of(cls, tables: list[tuple[str, int, int, int]], device: torch.device) -> BucketRanges:
        """From ``(name, num_buckets, lo, hi)`` per table, buckets laid end to end in that order."""
        starts = [sum(hi - lo for _, _, lo, hi in tables[:i]) for i in range(len(tables))]
        cols = list(zip(*((b, lo, hi - lo, s) for (_, b, lo, hi), s in zip(tables, starts, strict=True)), strict=True))
        nb, lo, count, start = (torch.tensor(c, dtype=torch.int64, device=device) for c in cols)
        partial = any((lo, hi) != (0, b) for _, b, lo, hi in tables)
        return cls(nb, lo, count, start, [t[0] for t in tables], partial)

    def out_of_range(self, ids: Tensor, table: Tensor | None, i: int) -> ValueError:
        """The error for id ``i``, which is not in its table's buckets here."""
        t = 0 if table is None else int(table[i])
        lo, count = int(self.lo[t]), int(self.count[t])
        return ValueError(
            f"dynamic table '{self.names[t]}': ids outside buckets [{lo}, {lo + count}) were sent to this mapper"
        )


@dataclass(frozen=True)
class SlotLookup:
    """Flat slots of one lookup: ``slots [N]`` (``-1``: missed), ``new [M]`` (re)assigned this step;
    ``new_per_table``: how many of ``new`` each table has, when the lookup read it anyway (else None)."""

    slots: Tensor
    new: Tensor
    new_per_table: list[int] | None = None


def _pick(step: Step, index: Tensor) -> Step:
    """``step[index]`` for a per-element step, ``step`` itself for a shared one."""
    return step[index] if isinstance(step, Tensor) and step.dim() > 0 else step


def _table_steps(steps: Tensor, table: Tensor | None) -> Step:
    """Each id's step (``steps [T]``; ``table`` None: one table, one shared 0-d step)."""
    return steps[0] if table is None else steps.index_select(0, table)


def locate(
    state: SlotState, ranges: BucketRanges, ids: Tensor, table: Tensor | None, steps: Tensor, train: bool
) -> tuple[Tensor, Tensor]:
    """``(flat bucket, live flat slot or -1)`` of every raw id ``ids [N]`` of table ``table [N]``
    (None: all of table 0); a training lookup records each hit (``steps[t]``, one sighting).

    Raises, naming the table, for an id outside its table's buckets here (nothing recorded).
    Runs the compiled loop (op ``shardrec::locate``, :mod:`.ops`) on CPU where it is built, else tensor ops.
    """
    loops = native_loops() if ids.device.type == "cpu" else None
    inputs = (ids, table, ranges.num_buckets, ranges.lo, ranges.count, ranges.start, steps)
    buffers = (state.slot_ids, state.slot_step, state.slot_count)
    if loops is not None and all(t is None or (t.is_contiguous() and t.dtype == torch.int64) for t in inputs + buffers):
        bucket, slot, bad = ops.locate(*inputs, state.width, *buffers, train)
        if int(bad) >= 0:
            raise ranges.out_of_range(ids, table, int(bad))
        return bucket, slot

    def per_table(values: Tensor) -> Tensor:
        return values[0] if table is None else values.index_select(0, table)

    local = bucket_of(ids, per_table(ranges.num_buckets)) - per_table(ranges.lo)
    if ranges.partial:
        bad = (local < 0) | (local >= per_table(ranges.count))
        if ranges.routed:  # in range by construction of the routing: kept safe without a host sync
            assert_async(~bad.any(), f"dynamic tables {ranges.names}: an id routed here is outside its buckets here")
        elif bool(bad.any()):
            raise ranges.out_of_range(ids, table, int(bad.nonzero()[0, 0]))
    bucket = local + per_table(ranges.start)
    slot = find(ids, bucket, state.slot_ids, state.slot_step, state.width)
    if train:  # masked, not compacted: no host sync
        hit = slot >= 0
        at = slot.clamp(min=0)  # repeated ids repeat their slot: the same step, one sighting each
        put_where(state.slot_step, at, _table_steps(steps, table), hit)
        state.slot_count.index_add_(0, at, hit.long())
    return bucket, slot


def lookup_slots(
    state: SlotState, ids: Tensor, bucket: Tensor, slot: Tensor, table: Tensor | None, steps: Tensor, train: bool
) -> SlotLookup:
    """Finish a lookup after :func:`locate` (``slot``: its live slots, hits recorded): eval lookups
    drop expired rows; training lookups admit the missing ids (``steps [T]``: each table's step).

    Only the missing ids are made unique (by bucket and id, sightings summed) for
    admission, so the sort is as small as the misses.
    """
    empty = ids.new_empty(0)
    if not train:
        ttl = state.config.ttl_steps
        if ttl is not None:
            step = _table_steps(steps, table)
            stale = (slot >= 0) & (step - state.slot_step[slot.clamp(min=0)] > ttl)
            slot = torch.where(stale, -1, slot)
        return SlotLookup(slot, empty)
    miss = (slot < 0).nonzero().squeeze(1)
    if miss.numel() == 0:
        return SlotLookup(slot, empty)
    ubucket, uniq, inverse, counts = _unique_pairs(bucket[miss], ids[miss])
    utable = None if table is None else table.index_select(0, miss.index_select(0, _first_of(inverse, uniq.numel())))
    got, new = _admit(state, uniq, ubucket, counts, _table_steps(steps, utable))
    lost = got < 0
    state.count("misses", ubucket[lost], counts[lost])
    slot[miss] = got[inverse]
    return SlotLookup(slot, new)


def expire(state: SlotState, slot_steps: Step, cand_steps: Step) -> None:
    """Free rows and candidates not seen for more than ``ttl_steps`` (steps: shared, or per entry)."""
    ttl = state.config.ttl_steps
    if ttl is None:
        return
    old = (state.slot_step >= 0) & (slot_steps - state.slot_step > ttl)
    state.counters[:, COUNTERS.index("expirations")] += old.view(-1, state.width).sum(1)
    state.slot_step.masked_fill_(old, -1)
    state.slot_count.masked_fill_(old, 0)
    old_cands = (state.cand_step >= 0) & (cand_steps - state.cand_step > ttl)
    state.cand_step.masked_fill_(old_cands, -1)
    state.cand_count.masked_fill_(old_cands, 0)


def _per_element(step: Step) -> bool:
    return isinstance(step, Tensor) and step.dim() > 0


def _first_of(inverse: Tensor, n: int) -> Tensor:
    """For each of ``n`` groups, one position of ``inverse`` holding it (every group occurs)."""
    return torch.empty(n, dtype=torch.long, device=inverse.device).scatter_(
        0, inverse, torch.arange(inverse.numel(), device=inverse.device)
    )


def sort_pairs(bucket: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(bucket, id)`` pairs sorted by bucket then id (ties in input order): ``(buckets, ids, change,
    group, inverse)``, ``change`` marking where a new pair starts, ``group`` the pair of each
    sorted entry and ``inverse`` that of each input entry. No host sync."""
    order = torch.sort(ids).indices
    order = order.index_select(0, torch.sort(bucket.index_select(0, order), stable=True).indices)
    b, i = bucket.index_select(0, order), ids.index_select(0, order)
    change = torch.ones_like(b, dtype=torch.bool)
    change[1:] = (b[1:] != b[:-1]) | (i[1:] != i[:-1])
    group = torch.cumsum(change, 0) - 1
    return b, i, change, group, torch.empty_like(group).scatter_(0, order, group)


def _unique_pairs(bucket: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Unique ``(bucket, id)`` pairs sorted by bucket then id: ``(buckets, ids, inverse, counts)``.

    Buckets of different tables differ, so a pair is a (table, id): the same raw id of two
    tables stays two entries.
    """
    b, i, change, group, inverse = sort_pairs(bucket, ids)
    starts = change.nonzero().squeeze(1)
    counts = torch.diff(starts, append=starts.new_full((1,), b.numel()))
    return b[starts], i[starts], inverse, counts


def _admit(state: SlotState, ids: Tensor, bucket: Tensor, counts: Tensor, step: Step) -> tuple[Tensor, Tensor]:
    """Slots (flat, ``-1``: none) for missing unique ids, and the slots newly assigned."""
    total, has_cand, cand = counts, None, None
    if state.cands:
        cand = find(ids, bucket, state.cand_ids, state.cand_step, state.cands)
        has_cand = cand >= 0
        total = counts + torch.where(has_cand, state.cand_count[cand.clamp(min=0)], 0)
    lfu = state.config.eviction is EvictionPolicy.LFU
    slots = (state.slot_ids, state.slot_step, state.slot_count)
    if cand is None:  # min_count 1: every missing id is ready, seen at most ``counts.sum()`` times
        got, displaced = place(ids, bucket, total, step, slots, state.width, lfu, counts.sum())
        placed = got
    else:
        ready = (total >= state.config.min_count).nonzero().squeeze(1)
        got = torch.full_like(ids, -1)
        placed, displaced = place(ids[ready], bucket[ready], total[ready], _pick(step, ready), slots, state.width, lfu)
        got[ready] = placed
    new = placed[placed >= 0]
    state.slot_gen[new] += 1
    state.count("admissions", new // state.width)
    state.count("evictions", displaced // state.width)
    if cand is not None and has_cand is not None:
        admitted = got >= 0
        freed = cand[admitted & has_cand]
        state.cand_step[freed], state.cand_count[freed] = -1, 0
        keep = (~admitted & has_cand).nonzero().squeeze(1)
        state.cand_step[cand[keep]], state.cand_count[cand[keep]] = _pick(step, keep), total[keep]
        fresh = (~admitted & ~has_cand).nonzero().squeeze(1)
        where, lost = place(
            ids[fresh],
            bucket[fresh],
            total[fresh],
            _pick(step, fresh),
            (state.cand_ids, state.cand_step, state.cand_count),
            state.cands,
            False,
        )
        state.count("dropped_candidates", torch.cat([lost // state.cands, bucket[fresh][where < 0]]))
    return got, new


def find(ids: Tensor, bucket: Tensor, held: Tensor, last: Tensor, width: int) -> Tensor:
    """Flat index of each id among its bucket's ``width`` live entries of ``held``, ``-1`` if absent.

    Only the first entry holding the id is checked for life: an entry keeps its id when it
    dies (expiry, or a candidate admitted), but a bucket fills its empty entries lowest
    first, so an id placed again lands at or before any dead copy of itself: its first
    copy is the live one if it has one.
    """
    out = torch.full_like(ids, -1)
    if width == 0 or ids.numel() == 0:
        return out
    step = max(1, _CHUNK // width)
    for start in range(0, ids.numel(), step):  # chunks bound memory, not a per-id loop
        part = slice(start, start + step)
        rows = bucket[part]
        held_rows = held.view(-1, width).index_select(0, rows)  # whole-row gathers: fast
        found, first = (held_rows == ids[part, None]).max(dim=1)
        entry = rows * width + first
        out[part] = torch.where(found & (last.index_select(0, entry) >= 0), entry, -1)
    return out


def _rank_in_group(group_sorted: Tensor) -> Tensor:
    """Position of each element within its run of equal values (input sorted)."""
    start = torch.searchsorted(group_sorted, group_sorted)
    return torch.arange(group_sorted.numel(), device=group_sorted.device) - start


def place(
    ids: Tensor,
    bucket: Tensor,
    total: Tensor,
    step: Step,
    table: tuple[Tensor, Tensor, Tensor],
    width: int,
    lfu: bool,
    most: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Give unique ``ids``, sorted by bucket then id, entries of their buckets in
    ``table = (held, last, count)`` at ``step`` (shared, or one per id).

    Ids go by most ``total`` then lowest id; entries free first, then (not seen
    this step) by policy, ties by lowest index. Returns each id's flat entry
    (``-1``: none left) and the occupied entries taken over. ``most``, an upper
    bound of ``total`` if known, lets one sort order the ids. On CPU the compiled
    loop (op ``shardrec::place``, :mod:`.ops`) does the same.
    """
    held, last, count = table
    if ids.numel() == 0:
        return torch.full_like(ids, -1), ids.new_zeros(0)
    loops = native_loops() if ids.device.type == "cpu" else None
    if loops is not None and all(t.is_contiguous() and t.dtype == torch.int64 for t in table):
        steps = torch.as_tensor(step, dtype=torch.int64).reshape(-1).contiguous()  # [1] shared, or [n]
        ids, bucket, total = (t.to(torch.int64).contiguous() for t in (ids, bucket, total))
        return ops.place(ids, bucket, total, steps, width, lfu, held, last, count)
    out, entries, displaced = place_fixed(ids, bucket, total, step, table, width, lfu, most)
    return out, entries[displaced]


def place_fixed(
    ids: Tensor,
    bucket: Tensor,
    total: Tensor,
    step: Step,
    table: tuple[Tensor, Tensor, Tensor],
    width: int,
    lfu: bool,
    most: Tensor | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`place`'s tensor ops on ``N`` ids in ``[N]``-sized tensors, with no host sync.

    Only ids ``valid [N]`` (None: all) are placed; the others go after every bucket, so
    the valid ones keep their order and ranks. Returns each id's flat entry (``-1``:
    none, or not valid), and, in sorted order, the entry each id was ranked for
    (``[N]``, in range) and whether it took over an occupied one (``[N]`` bool).
    """
    held, last, count = table
    buckets = held.numel() // width
    if ids.numel() == 0:
        return torch.full_like(ids, -1), ids.new_zeros(0), ids.new_zeros(0, dtype=torch.bool)
    if valid is not None:
        bucket, total = torch.where(valid, bucket, buckets), torch.where(valid, total, 0)
    if most is not None:  # one key: bucket, then most sightings; ids arrive sorted, so ties stay by id
        order = torch.sort(bucket * (most + 1) + (most - total), stable=True).indices
    else:
        order = torch.sort(-total, stable=True).indices
        order = order[torch.sort(bucket[order], stable=True).indices]
    b_sorted = bucket[order]
    rank = _rank_in_group(b_sorted)
    change = torch.ones_like(b_sorted, dtype=torch.bool)  # unique_consecutive, padded to [N]: no sync
    change[1:] = b_sorted[1:] != b_sorted[:-1]
    row = torch.cumsum(change, 0) - 1
    touched = torch.zeros_like(b_sorted).scatter_(0, row, b_sorted).clamp_(max=buckets - 1)
    id_step = _pick(step, order)
    if _per_element(step):  # every id of a bucket has its bucket's step
        assert isinstance(id_step, Tensor)
        bucket_step: Step = torch.zeros_like(touched).scatter_(0, row, id_step)[:, None]
    else:
        bucket_step = step
    seen = last.view(-1, width).index_select(0, touched)
    free = seen < bucket_step  # empty (-1) or not seen this step
    # by last seen, entries seen this step after all others, ties by lowest entry: a key
    # unique within its bucket, so the (faster) unstable sort gives the stable order
    cols = torch.arange(width, device=ids.device)
    key = torch.where(free, seen + 1, bucket_step + 1) * width + cols
    perm = torch.sort(key, dim=1).indices
    if lfu:
        counts = count.view(-1, width).index_select(0, touched)
        by_count = torch.where(free, counts, _INT64_MAX).gather(1, perm)
        perm = perm.gather(1, torch.sort(by_count, dim=1, stable=True).indices)
    ranked = touched[:, None] * width + perm
    wins = rank < free.sum(dim=1)[row]
    if valid is not None:
        wins &= valid[order]
    target = ranked.view(-1)[row * width + rank.clamp(max=width - 1)]
    displaced = wins & (last[target] >= 0)
    put_where(held, target, ids[order], wins)
    put_where(count, target, total[order], wins)
    put_where(last, target, id_step, wins)
    out = torch.full_like(ids, -1)
    out[order] = torch.where(wins, target, -1)
    return out, target, displaced


def put_where(buf: Tensor, index: Tensor, value: Tensor | int, mask: Tensor) -> None:
    """``buf[index[i]] = value[i]`` where ``mask[i]`` (``value``: ``[N]``, 0-d or an int), in a fixed
    number of ops: no compaction, so no host sync. ``index [N]`` must be in range everywhere, and
    masked-in entries of one index must carry one value (they are written in any order).

    The masked-out entries write the first masked-in entry's value again (or, if there is
    none, its entry's own value), so no write of theirs can change anything.
    """
    if index.numel() == 0:
        return
    if isinstance(value, Tensor):
        value = value.to(buf.dtype).expand(index.shape)
    else:
        value = torch.full_like(index, value, dtype=buf.dtype)
    first = mask.to(torch.int32).argmax().view(1)  # the first masked-in entry (0: none)
    at = index.index_select(0, first)
    again = torch.where(mask.index_select(0, first), value.index_select(0, first), buf.index_select(0, at))
    buf.index_put_((torch.where(mask, index, at),), torch.where(mask, value, again))


def uses_compiled_loops(ids: Tensor) -> bool:
    """Whether lookups of ``ids`` run the compiled CPU loops (else the sync-free tensor ops)."""
    return ids.device.type == "cpu" and native_loops() is not None
