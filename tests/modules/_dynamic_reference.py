"""A plain-Python, one-bucket-at-a-time model of a dynamic table's id -> slot semantics.

Written from the rules in ``docs/dynamic-tables.md`` ("Semantics") alone, with dicts and
loops, to check the vectorised mapper against: the bucket formula is computed here from
the documented hash (nothing of the library is used), each step frees what ``ttl_steps``
expires before its lookups, and every counter counts what the docs say it counts.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The documented finalizer on the id's 64 bits read as unsigned (all mod 2**64, logical shifts)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def bucket(id_: int, num_buckets: int) -> int:
    """``bucket(id) = (splitmix64(id) >> 1) mod num_buckets``."""
    return (splitmix64(id_ & MASK) >> 1) % num_buckets


ODD_IDS = [0, 1, -1, 7, -(2**63), 2**63 - 1, 123_456_789_012_345, -987_654_321_098]


def stream(steps: int, pool: int, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [rng.choice([-1, 1]) * rng.randrange(2**62) for _ in range(pool)] + ODD_IDS
    return [[rng.choice(ids[: 4 + (len(ids) - 4) * (s + 1) // steps]) for _ in range(batch)] for s in range(steps)]


@dataclass
class Entry:
    id: int
    step: int
    count: int


class ReferenceMapper:
    def __init__(self, buckets: int, slots: int, cands: int, min_count: int, lfu: bool, ttl: int | None) -> None:
        self.B, self.S, self.K = buckets, slots, cands
        self.min_count, self.lfu, self.ttl = min_count, lfu, ttl
        self.slots: list[list[Entry | None]] = [[None] * slots for _ in range(buckets)]
        self.cands: list[list[Entry | None]] = [[None] * cands for _ in range(buckets)]
        self.gen = [0] * (buckets * slots)
        self.stats = Counter()

    def _key(self, e: Entry | None, j: int) -> tuple[int, ...]:
        step, count = (-1, 0) if e is None else (e.step, e.count)
        return (count, step, j) if self.lfu else (step, j)

    def lookup(self, ids: list[int], step: int, train: bool) -> tuple[list[int], dict[int, int]]:
        """Slots of ``ids`` (-1: miss) and ``{new slot: generation}``."""
        counts = Counter(ids)
        bucket_of_id = {i: bucket(i, self.B) for i in counts}
        slot_of: dict[int, int] = {}
        new: dict[int, int] = {}
        if train and self.ttl is not None:
            for table, counted in ((self.slots, True), (self.cands, False)):
                for row in table:
                    for j, e in enumerate(row):
                        if e is not None and step - e.step > self.ttl:
                            row[j] = None
                            self.stats["expirations"] += counted
        for b in range(self.B):
            mine = sorted(i for i in counts if bucket_of_id[i] == b)
            row, cand = self.slots[b], self.cands[b]
            where = {e.id: j for j, e in enumerate(row) if e is not None}
            misses = []
            for i in mine:
                if i in where:
                    e = row[where[i]]
                    if not train:
                        if self.ttl is None or step - e.step <= self.ttl:
                            slot_of[i] = b * self.S + where[i]
                        continue
                    e.step, e.count = step, e.count + counts[i]
                    slot_of[i] = b * self.S + where[i]
                else:
                    misses.append(i)
            if not train:
                continue
            in_cand = {e.id: j for j, e in enumerate(cand) if e is not None}
            total = {i: counts[i] + (cand[in_cand[i]].count if i in in_cand else 0) for i in misses}
            ready = sorted((i for i in misses if total[i] >= self.min_count), key=lambda i: (-total[i], i))
            free = sorted(
                (j for j in range(self.S) if row[j] is None or row[j].step < step), key=lambda j: self._key(row[j], j)
            )
            admitted = set()
            for i, j in zip(ready, free, strict=False):
                self.stats["evictions"] += row[j] is not None
                row[j] = Entry(i, step, total[i])
                s = b * self.S + j
                self.gen[s] += 1
                new[s] = self.gen[s]
                slot_of[i] = s
                admitted.add(i)
            self.stats["admissions"] += len(admitted)
            if not self.K:
                continue
            for i in misses:
                if i in in_cand:
                    if i in admitted:
                        cand[in_cand[i]] = None
                    else:
                        cand[in_cand[i]].step, cand[in_cand[i]].count = step, total[i]
            fresh = sorted((i for i in misses if i not in admitted and i not in in_cand), key=lambda i: (-total[i], i))
            free_c = sorted(
                (j for j in range(self.K) if cand[j] is None or cand[j].step < step),
                key=lambda j: (-1 if cand[j] is None else cand[j].step, j),
            )
            for n, i in enumerate(fresh):
                if n < len(free_c):
                    j = free_c[n]
                    self.stats["dropped_candidates"] += cand[j] is not None
                    cand[j] = Entry(i, step, total[i])
                else:
                    self.stats["dropped_candidates"] += 1
        out = [slot_of.get(i, -1) for i in ids]
        if train:
            self.stats["misses"] += sum(1 for s in out if s < 0)
        return out, new

    def counters(self) -> dict[str, int]:
        occupancy = sum(e is not None for row in self.slots for e in row)
        names = ("admissions", "evictions", "expirations", "misses", "dropped_candidates")
        return {"occupancy": occupancy, **{n: self.stats[n] for n in names}}
