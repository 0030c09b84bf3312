"""Raw id -> slot mapping of a dynamic table, vectorised (no per-id Python).

The table is ``B`` buckets of ``S`` slots; slot ``b * S + j`` is slot ``j`` of bucket
``b``. An id lives in bucket ``(mix64(id) >> 1) mod B`` (logical shift, :func:`bucket_of`), and each bucket
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
   (each candidate replaced or dropped is counted in ``dropped_candidates``; candidates
   freed by step 1 or admitted are not).

The rules as users read them, and what each counter counts: ``docs/dynamic-tables.md``
("Semantics"), which the tests check against a plain-Python model written from it.

Eval lookups (``train=False``) change nothing: resident, unexpired ids hit, others miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_shardrec.configs import DynamicConfig
from lightning_shardrec.modules.dynamic.admission import lookup_slots_fixed
from lightning_shardrec.modules.dynamic.hashing import mix64, shr
from lightning_shardrec.modules.dynamic.layout import BUFFERS, DynamicLayout, layout_problems
from lightning_shardrec.modules.dynamic.slots import (
    COUNTERS,
    BucketRanges,
    SlotState,
    expire,
    locate,
    lookup_slots,
    uses_compiled_loops,
)

WINDOW_FIELDS = ("window_lookups", "window_misses", "window_ids")
"""A mapper's window figures (:meth:`DynamicIdMapper.window_figures`), in this order."""
WINDOW_BITS_PER_SLOT = 4
"""Bits (one byte each, bool) of the window's id bitmap per slot: distinct-id estimates stay within a few
percent up to several times the capacity; a bucket saturates (reads a lower bound) past about 16 ids per slot."""


WINDOW_BUFFERS = ("window", "window_ids")
"""A mapper's window buffers (not saved; a :class:`~.mapper_group.MapperGroup` makes them views too)."""


def record_window(
    window: Tensor,
    window_ids: Tensor,
    bits: int,
    ids: Tensor,
    bucket: Tensor,
    num_buckets: int | Tensor,
    table: Tensor | None,
    missed: Tensor,
) -> None:
    """Add a training lookup to the windows of ``T`` tables laid end to end (no host sync).

    ``window [2T]``: (lookups, misses) per table; ``window_ids``: ``bits`` bits per flat bucket;
    ``ids, bucket, missed [N]``: each id, its flat bucket (:func:`~.slots.locate`) and whether it missed;
    ``num_buckets``: its table's bucket count (an int, or per id); ``table [N]``: each id's table (None: 0).
    An id sets bit ``(h // B) % bits`` of its bucket, ``h`` the hash whose ``h % B`` is its bucket.
    """
    top = shr(mix64(ids), 1)
    window_ids[bucket * bits + torch.div(top, num_buckets, rounding_mode="floor") % bits] = True
    counts = torch.stack([torch.ones_like(ids), missed.long()], 1)
    if table is None:
        window.add_(counts.sum(0))
    else:
        window.view(-1, 2).index_add_(0, table, counts)


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


class DynamicIdMapper(nn.Module):
    """Slot state of one dynamic table (or of its buckets ``[lo, hi)``), as buffers.

    Buffers (``W = hi - lo`` local buckets): ``slot_ids / slot_step / slot_count /
    slot_gen [W*S]`` (the held id, last step seen (``-1``: empty), sightings, times
    assigned), ``cand_ids / cand_step / cand_count [W*K]`` (admission candidates),
    ``step`` (training steps taken) and ``counters [W, 5]`` (:data:`COUNTERS` of each
    local bucket, so a reshard keeps them exact; :meth:`stats` sums them).

    The current *window* (training lookups since the mapper was built or
    :meth:`new_window`) lives in two buffers that checkpoints do not hold:
    ``window [2]`` (ids looked up, ids missed) and ``window_ids [W * WINDOW_BITS_PER_SLOT * S]``,
    a linear-counting bitmap per bucket of the ids looked up, from which :meth:`window_figures`
    estimates how many distinct ids each bucket saw (summed: any split of the buckets over
    ranks gives the whole table's figure).
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
    window: Tensor
    window_ids: Tensor

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
        self._add_window()
        self._ranges: BucketRanges | None = None

    def _add_window(self) -> None:
        """Register the window's buffers (empty), next to the slots."""
        device, bits = self.slot_ids.device, WINDOW_BITS_PER_SLOT * self.slot_ids.numel()
        self.register_buffer("window", torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("window_ids", torch.zeros(bits, dtype=torch.bool, device=device), persistent=False)

    def __setstate__(self, state: dict) -> None:  # type: ignore[type-arg]
        """A mapper pickled before the window existed gets an empty one."""
        super().__setstate__(state)
        if "window" not in self._buffers:
            self._add_window()

    @property
    def capacity(self) -> int:
        return self.slot_ids.numel()

    def stats(self) -> dict[str, int]:
        """Occupancy, capacity, candidates held and the cumulative :data:`COUNTERS` (ints); the window:
        :meth:`window_figures`."""
        out = {
            "occupancy": int((self.slot_step >= 0).sum()),
            "capacity": self.capacity,
            "candidates": int((self.cand_step >= 0).sum()),
        }
        out.update(zip(COUNTERS, (int(c) for c in self.counters.sum(0).tolist()), strict=True))
        return out

    def window_figures(self) -> Tensor:
        """``[3]`` int64: the window's lookups, misses and (estimated) distinct ids, on the mapper's device.

        Distinct ids by linear counting, bucket by bucket: ``M ln(M / zeros)`` for a bucket's ``M`` bits,
        rounded, summed over buckets (no host sync); a full bucket reads ``M ln M`` (a lower bound).
        """
        m = WINDOW_BITS_PER_SLOT * self.slots_per_bucket
        zeros = (~self.window_ids).view(-1, m).sum(1).clamp(min=1).double()
        distinct = (m * torch.log(m / zeros)).round().long().sum().reshape(1)
        return torch.cat([self.window, distinct])

    def new_window(self) -> None:
        """Start a new window: its lookups, misses and ids from zero."""
        self.window.zero_()
        self.window_ids.zero_()

    def layout(self) -> DynamicLayout:
        """The whole table's layout (``dim`` unknown here: 0)."""
        return DynamicLayout(self.table, self.num_buckets, self.slots_per_bucket, self.cands_per_bucket, 0)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """Buffers that a :class:`~lightning_shardrec.modules.dynamic.mapper_group.MapperGroup` made views of
        one flat tensor are saved as tensors of their own (a save never carries other tables' state)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in BUFFERS:
            t = destination.get(prefix + name)
            if isinstance(t, Tensor) and t.untyped_storage().nbytes() != t.nbytes:
                destination[prefix + name] = t.clone()

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

    def state(self) -> SlotState:
        """This mapper's buffers as the flat state of its ``hi - lo`` buckets (the same tensors)."""
        return SlotState.of(dict(self.named_buffers()), self.slots_per_bucket, self.cands_per_bucket, self.config)

    def bucket_ranges(self) -> BucketRanges:
        """This mapper's buckets as one table's :class:`BucketRanges` (made once per device)."""
        device = self.slot_ids.device
        ranges = getattr(self, "_ranges", None)  # absent from mappers pickled before it existed
        if ranges is None or ranges.lo.device != device:
            ranges = BucketRanges.of([(self.table, self.num_buckets, self.bucket_lo, self.bucket_hi)], device)
            self._ranges = ranges
        return ranges

    def map(self, ids: Tensor, train: bool) -> LookupResult:
        """:meth:`lookup` at this mapper's own step, which a training lookup advances."""
        result = self.lookup(ids, self.step, train)  # the step stays a tensor: no device sync
        if train:
            self.step += 1
        return result

    @torch.no_grad()
    def lookup(self, ids: Tensor, step: int | Tensor, train: bool) -> LookupResult:
        """Map raw ids ``[N]`` to global slots (``-1``: not admitted) at training step ``step``."""
        ids = ids.reshape(-1).to(device=self.slot_ids.device, dtype=torch.int64).contiguous()
        steps = torch.as_tensor(step, dtype=torch.int64, device=ids.device).reshape(1)
        state = self.state()
        if train:
            expire(state, steps[0], steps[0])
        bucket, slot = locate(state, self.bucket_ranges(), ids, None, steps, train)
        finish = lookup_slots if uses_compiled_loops(ids) else lookup_slots_fixed
        found = finish(state, ids, bucket, slot, None, steps, train)
        if train:
            bits = WINDOW_BITS_PER_SLOT * self.slots_per_bucket
            record_window(self.window, self.window_ids, bits, ids, bucket, self.num_buckets, None, found.slots < 0)
        slots = torch.where(found.slots >= 0, found.slots + self.row_offset, -1)
        return LookupResult(slots, found.new + self.row_offset, self.slot_gen[found.new])
