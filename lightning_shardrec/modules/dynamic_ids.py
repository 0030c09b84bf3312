"""Raw id -> slot mapping of a dynamic table, vectorised (no per-id Python).

The table is ``B`` buckets of ``S`` slots; slot ``b * S + j`` is slot ``j`` of bucket
``b``. An id lives in bucket ``mix64(id) mod B`` (:func:`bucket_of`), and each bucket
admits and evicts on its own, so a mapper over buckets ``[lo, hi)`` fed only the ids
of those buckets makes exactly the choices the whole-table mapper makes for them:
any contiguous range of buckets can live on one rank.

A batch is processed as a set (the sightings of each unique id are summed), so the
order of ids in a batch never changes a result. Per training step:

1. (``ttl_steps``) rows and candidates not seen for more than ``ttl_steps`` steps are freed;
2. resident ids hit their slot (last-seen step and sighting count updated);
3. (``min_count > 1``) missing ids add their sightings to a bounded per-bucket
   candidate table; those with ``min_count`` sightings in all are *ready*
   (with ``min_count == 1`` every missing id is ready);
4. ready ids of a bucket, by most sightings then lowest id, take its free slots
   (lowest first), then evict rows not seen this step in policy order (LRU: oldest
   step; LFU: fewest sightings, then oldest), ties broken by the lowest slot;
5. ready ids left without a slot, and ids not ready, read zeros this step (counted as
   misses) and stay candidates; a new candidate that finds its bucket's candidate table
   full replaces the least recently seen candidate not seen this step, else is dropped
   (each lost candidate is counted in ``dropped_candidates``).

Eval lookups (``train=False``) change nothing: resident, unexpired ids hit, others miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import DynamicConfig, EvictionPolicy
from lightning_shardrec.modules.dynamic_layout import BUFFERS, DynamicLayout, layout_problems

COUNTERS = ("admissions", "evictions", "expirations", "misses", "dropped_candidates")
_INT64_MAX = torch.iinfo(torch.int64).max
_CHUNK = 1 << 22  # elements of an [ids, slots] comparison done at once


def _s64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)


def shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``k`` bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64 of int64 ``x`` (two's-complement wraparound), elementwise, any device."""
    z = x + GOLDEN
    z ^= shr(z, 30)  # in place: one new tensor in all
    z *= _C1
    z ^= shr(z, 27)
    z *= _C2
    return z.bitwise_xor_(shr(z, 31))


def bucket_of(ids: Tensor, num_buckets: int | Tensor) -> Tensor:
    """Bucket in ``[0, num_buckets)`` of every raw int64 id: the top 63 hash bits mod ``num_buckets``
    (an int, or a tensor of per-id bucket counts)."""
    return shr(mix64(ids.long()), 1) % num_buckets


@dataclass(frozen=True)
class LookupResult:
    """One lookup. ``slots [N]``: the global slot of each id, ``-1`` where it missed.

    ``new_slots [M]`` were (re)assigned this step and must be reset (weights and
    optimizer state) before use; ``new_generations [M]`` is how many times each has
    been assigned, which with the slot seeds its fresh row.
    """

    slots: Tensor
    new_slots: Tensor
    new_generations: Tensor


def _rank_in_group(group_sorted: Tensor) -> Tensor:
    """Position of each element within its run of equal values (input sorted)."""
    start = torch.searchsorted(group_sorted, group_sorted)
    return torch.arange(group_sorted.numel(), device=group_sorted.device) - start


class DynamicIdMapper(nn.Module):
    """Slot state of one dynamic table (or of its buckets ``[lo, hi)``), as buffers.

    Buffers (``W = hi - lo`` local buckets): ``slot_ids / slot_step / slot_count /
    slot_gen [W*S]`` (the held id, last step seen (``-1``: empty), sightings, times
    assigned), ``cand_ids / cand_step / cand_count [W*K]`` (admission candidates),
    ``step`` (training steps taken) and ``counters [W, 5]`` (:data:`COUNTERS` of each
    local bucket, so a reshard keeps them exact; :meth:`stats` sums them).
    """

    slot_ids: Tensor
    slot_step: Tensor
    slot_count: Tensor
    slot_gen: Tensor
    cand_ids: Tensor
    cand_step: Tensor
    cand_count: Tensor
    counters: Tensor
    step: Tensor

    def __init__(
        self,
        table: str,
        config: DynamicConfig,
        num_embeddings: int,
        bucket_range: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.table, self.config = table, config
        self.num_buckets, self.slots_per_bucket = config.layout(num_embeddings, table)
        lo, hi = bucket_range if bucket_range is not None else (0, self.num_buckets)
        if not 0 <= lo < hi <= self.num_buckets:
            raise ValueError(
                f"dynamic table '{table}': bucket range [{lo}, {hi}) is not a non-empty part of [0, {self.num_buckets})"
            )
        self.bucket_lo, self.bucket_hi = lo, hi
        self.row_offset = lo * self.slots_per_bucket
        self.cands_per_bucket = config.candidate_slots(self.slots_per_bucket)
        rows, cands = (hi - lo) * self.slots_per_bucket, (hi - lo) * self.cands_per_bucket

        def buf(name: str, n: int, fill: int) -> None:
            self.register_buffer(name, torch.full((n,), fill, dtype=torch.int64, device=device))

        for name, n, fill in (
            ("slot_ids", rows, 0),
            ("slot_step", rows, -1),
            ("slot_count", rows, 0),
            ("slot_gen", rows, 0),
            ("cand_ids", cands, 0),
            ("cand_step", cands, -1),
            ("cand_count", cands, 0),
        ):
            buf(name, n, fill)
        self.register_buffer("counters", torch.zeros(hi - lo, len(COUNTERS), dtype=torch.int64, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))

    @property
    def capacity(self) -> int:
        return self.slot_ids.numel()

    def stats(self) -> dict[str, int]:
        """Occupancy, capacity, candidates held and the cumulative :data:`COUNTERS` (ints)."""
        out = {
            "occupancy": int((self.slot_step >= 0).sum()),
            "capacity": self.capacity,
            "candidates": int((self.cand_step >= 0).sum()),
        }
        out.update(zip(COUNTERS, (int(c) for c in self.counters.sum(0).tolist()), strict=True))
        return out

    def layout(self) -> DynamicLayout:
        """The whole table's layout (``dim`` unknown here: 0)."""
        return DynamicLayout(self.table, self.num_buckets, self.slots_per_bucket, self.cands_per_bucket, 0)

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """A whole-table mapper refuses a state dict of another layout with a message naming the table."""
        if (self.bucket_lo, self.bucket_hi) == (0, self.num_buckets):
            saved = {b: tuple(state_dict[prefix + b].shape) for b in BUFFERS if prefix + b in state_dict}
            changed = [p for p in layout_problems(self.layout(), saved, where=prefix) if p.startswith("dynamic")]
            if saved and changed:
                error_msgs.extend(changed)
                return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _count(self, name: str, bucket: Tensor, amount: Tensor | None = None) -> None:
        """Add ``amount [N]`` (default: 1 each) to counter ``name`` of local buckets ``bucket [N]``."""
        col = torch.full_like(bucket, COUNTERS.index(name))
        value = torch.ones_like(bucket) if amount is None else amount.long()
        self.counters.index_put_((bucket, col), value, accumulate=True)

    def map(self, ids: Tensor, train: bool) -> LookupResult:
        """:meth:`lookup` at this mapper's own step, which a training lookup advances."""
        result = self.lookup(ids, self.step, train)  # the step stays a tensor: no device sync
        if train:
            self.step += 1
        return result

    @torch.no_grad()
    def lookup(self, ids: Tensor, step: int | Tensor, train: bool) -> LookupResult:
        """Map raw ids ``[N]`` to global slots (``-1``: not admitted) at training step ``step``.

        Every id is looked up where it stands (no sort): ids already resident are
        the common case. Only the missing ids are made unique (sorted, sightings
        summed) for admission, so the sort is as small as the misses.
        """
        ids = ids.reshape(-1).to(device=self.slot_ids.device, dtype=torch.int64)
        empty = ids.new_empty(0)
        if ids.numel() == 0:
            if train:
                self._expire(step)
            return LookupResult(ids.new_empty(0), empty, empty)
        bucket = bucket_of(ids, self.num_buckets)
        if (self.bucket_lo, self.bucket_hi) != (0, self.num_buckets):  # a whole table holds every bucket
            bucket = bucket - self.bucket_lo
            if bool(((bucket < 0) | (bucket >= self.bucket_hi - self.bucket_lo)).any()):
                raise ValueError(
                    f"dynamic table '{self.table}': ids outside buckets [{self.bucket_lo}, {self.bucket_hi}) "
                    "were sent to this mapper"
                )
        ttl = self.config.ttl_steps
        if train:
            self._expire(step)
        slot = self._find(ids, bucket, self.slot_ids, self.slot_step, self.slots_per_bucket)
        if not train:
            if ttl is not None:
                stale = (slot >= 0) & (step - self.slot_step[slot.clamp(min=0)] > ttl)
                slot = torch.where(stale, -1, slot)
            return LookupResult(torch.where(slot >= 0, slot + self.row_offset, -1), empty, empty)
        hit = slot >= 0
        hits = slot[hit]  # repeated ids repeat their slot: the same step, one sighting each
        self.slot_step[hits] = step
        self.slot_count.index_add_(0, hits, torch.ones_like(hits))
        miss = (~hit).nonzero().squeeze(1)
        uniq, inverse, counts = torch.unique(ids[miss], sorted=True, return_inverse=True, return_counts=True)
        ubucket = torch.empty_like(uniq).scatter_(0, inverse, bucket[miss])
        got, new = self._admit(uniq, ubucket, counts, step)
        lost = got < 0
        self._count("misses", ubucket[lost], counts[lost])
        slot[miss] = got[inverse]
        glob = torch.where(slot >= 0, slot + self.row_offset, -1)
        return LookupResult(glob, new + self.row_offset, self.slot_gen[new])

    def _expire(self, step: int | Tensor) -> None:
        ttl = self.config.ttl_steps
        if ttl is None:
            return
        old = (self.slot_step >= 0) & (step - self.slot_step > ttl)
        self.counters[:, COUNTERS.index("expirations")] += old.view(-1, self.slots_per_bucket).sum(1)
        self.slot_step.masked_fill_(old, -1)
        self.slot_count.masked_fill_(old, 0)
        old_cands = (self.cand_step >= 0) & (step - self.cand_step > ttl)
        self.cand_step.masked_fill_(old_cands, -1)
        self.cand_count.masked_fill_(old_cands, 0)

    def _admit(self, ids: Tensor, bucket: Tensor, counts: Tensor, step: int | Tensor) -> tuple[Tensor, Tensor]:
        """Slots (local, ``-1``: none) for missing unique ids, and the slots newly assigned."""
        total, has_cand, cand = counts, None, None
        if self.cands_per_bucket:
            cand = self._find(ids, bucket, self.cand_ids, self.cand_step, self.cands_per_bucket)
            has_cand = cand >= 0
            total = counts + torch.where(has_cand, self.cand_count[cand.clamp(min=0)], 0)
        lfu = self.config.eviction is EvictionPolicy.LFU
        slots = (self.slot_ids, self.slot_step, self.slot_count)
        if cand is None:  # min_count 1: every missing id is ready, seen at most ``counts.sum()`` times
            most = counts.sum()
            got, displaced = self._place(ids, bucket, total, step, slots, self.slots_per_bucket, lfu, most)
            placed = got
        else:
            ready = (total >= self.config.min_count).nonzero().squeeze(1)
            got = torch.full_like(ids, -1)
            placed, displaced = self._place(
                ids[ready], bucket[ready], total[ready], step, slots, self.slots_per_bucket, lfu
            )
            got[ready] = placed
        new = placed[placed >= 0]
        self.slot_gen[new] += 1
        self._count("admissions", new // self.slots_per_bucket)
        self._count("evictions", displaced // self.slots_per_bucket)
        if cand is not None and has_cand is not None:
            admitted = got >= 0
            freed = cand[admitted & has_cand]
            self.cand_step[freed], self.cand_count[freed] = -1, 0
            keep = ~admitted & has_cand
            self.cand_step[cand[keep]], self.cand_count[cand[keep]] = step, total[keep]
            fresh = (~admitted & ~has_cand).nonzero().squeeze(1)
            where, lost = self._place(
                ids[fresh],
                bucket[fresh],
                total[fresh],
                step,
                (self.cand_ids, self.cand_step, self.cand_count),
                self.cands_per_bucket,
                False,
            )
            width = self.cands_per_bucket
            self._count("dropped_candidates", torch.cat([lost // width, bucket[fresh][where < 0]]))
        return got, new

    @staticmethod
    def _find(ids: Tensor, bucket: Tensor, held: Tensor, last: Tensor, width: int) -> Tensor:
        """Local index of each id in its bucket's ``width`` entries of ``held``, ``-1`` if absent."""
        out = torch.full_like(ids, -1)
        if width == 0 or ids.numel() == 0:
            return out
        step = max(1, _CHUNK // width)
        for start in range(0, ids.numel(), step):  # chunks bound memory, not a per-id loop
            part = slice(start, start + step)
            rows = bucket[part]
            held_rows = held.view(-1, width).index_select(0, rows)  # whole-row gathers: fast
            match = (held_rows == ids[part, None]) & (last.view(-1, width).index_select(0, rows) >= 0)
            found, first = match.max(dim=1)  # the first match (an id is held once per bucket)
            out[part] = torch.where(found, rows * width + first, -1)
        return out

    @staticmethod
    def _place(
        ids: Tensor,
        bucket: Tensor,
        total: Tensor,
        step: int | Tensor,
        table: tuple[Tensor, Tensor, Tensor],
        width: int,
        lfu: bool,
        most: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Give unique ``ids`` entries of their buckets in ``table = (held, last, count)``.

        Ids go by most ``total`` then lowest id; entries free first, then (not seen
        this step) by policy, ties by lowest index. Returns each id's local entry
        (``-1``: none left) and the occupied entries taken over. ``most``, an upper
        bound of ``total`` if known, lets one sort order the ids.
        """
        held, last, count = table
        if ids.numel() == 0:
            return torch.full_like(ids, -1), ids.new_zeros(0)
        if most is not None:  # one key: bucket, then most sightings; ids arrive sorted, so ties stay by id
            order = torch.sort(bucket * (most + 1) + (most - total), stable=True).indices
        else:
            order = torch.sort(-total, stable=True).indices
            order = order[torch.sort(bucket[order], stable=True).indices]
        b_sorted = bucket[order]
        rank = _rank_in_group(b_sorted)
        touched, row = torch.unique_consecutive(b_sorted, return_inverse=True)
        seen = last.view(-1, width).index_select(0, touched)
        free = seen < step  # empty (-1) or not seen this step
        # by last seen, entries seen this step after all others, ties by lowest entry: a key
        # unique within its bucket, so the (faster) unstable sort gives the stable order
        cols = torch.arange(width, device=ids.device)
        key = torch.where(free, seen + 1, step + 1) * width + cols
        perm = torch.sort(key, dim=1).indices
        if lfu:
            counts = count.view(-1, width).index_select(0, touched)
            by_count = torch.where(free, counts, _INT64_MAX).gather(1, perm)
            perm = perm.gather(1, torch.sort(by_count, dim=1, stable=True).indices)
        ranked = touched[:, None] * width + perm
        wins = rank < free.sum(dim=1)[row]
        target = ranked.view(-1)[row * width + rank.clamp(max=width - 1)]
        chosen = target[wins]
        displaced = chosen[last[chosen] >= 0]
        held[chosen], last[chosen], count[chosen] = ids[order][wins], step, total[order][wins]
        out = torch.full_like(ids, -1)
        out[order] = torch.where(wins, target, -1)
        return out, displaced
