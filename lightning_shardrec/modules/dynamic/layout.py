"""The global layout of a dynamic table's id mapping, as checkpoints hold it.

A dynamic table of ``B`` buckets (``S`` slots and ``K`` admission candidates each)
keeps its mapping in the buffers of :class:`~lightning_shardrec.modules.DynamicIdMapper`;
globally (the unsharded module's state dict, and every checkpoint format) they are:

==========================================  ============  ==============================
buffer                                      global shape  chunk of a mapper over [lo, hi)
``slot_ids slot_step slot_count slot_gen``  ``[B * S]``   ``[lo * S, hi * S)``
``cand_ids cand_step cand_count``           ``[B * K]``   ``[lo * K, hi * K)``
``counters``                                ``[B, 5]``    rows ``[lo, hi)``
``step``                                    ``[]``        all of it (the same on every rank)
==========================================  ============  ==============================

So any bucket range reads its state by slicing the global tensors (resharding is
slicing, as for row-wise tables), and a checkpoint whose layout differs from the
model's (capacity, bucket count, candidates per bucket, dim) is refused by
:func:`layout_problems` with the table and both numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_shardrec.configs import BaseEmbeddingConfig

#: buffer -> what its first dimension counts: "slot" (S per bucket), "cand" (K per bucket), "bucket", "step"
BUFFERS = {
    "slot_ids": "slot",
    "slot_step": "slot",
    "slot_count": "slot",
    "slot_gen": "slot",
    "cand_ids": "cand",
    "cand_step": "cand",
    "cand_count": "cand",
    "counters": "bucket",
    "step": "step",
}
NUM_COUNTERS = 5


@dataclass(frozen=True)
class DynamicLayout:
    """Shape of one dynamic table's mapping: ``num_buckets`` buckets of ``slots_per_bucket`` rows."""

    table: str
    num_buckets: int
    slots_per_bucket: int
    cands_per_bucket: int
    dim: int

    @classmethod
    def of(cls, config: BaseEmbeddingConfig) -> DynamicLayout:
        """The layout of dynamic table ``config`` (its ``dynamic`` must be set)."""
        if config.dynamic is None:
            raise ValueError(f"table '{config.name}' is not dynamic (its config has dynamic=None)")
        buckets, slots = config.dynamic.layout(config.num_embeddings, config.name)
        return cls(config.name, buckets, slots, config.dynamic.candidate_slots(slots), config.embedding_dim)

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.slots_per_bucket

    def _per_bucket(self, buffer: str) -> int:
        return {"slot": self.slots_per_bucket, "cand": self.cands_per_bucket, "bucket": 1}[BUFFERS[buffer]]

    def size(self, buffer: str) -> tuple[int, ...]:
        """Global shape of ``buffer``."""
        if buffer == "step":
            return ()
        if buffer == "counters":
            return (self.num_buckets, NUM_COUNTERS)
        return (self.num_buckets * self._per_bucket(buffer),)

    def chunk(self, buffer: str, lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` of buckets ``[lo, hi)``'s part of ``buffer`` (``step``: all of it)."""
        if buffer == "step":
            return (), ()
        n = self._per_bucket(buffer)
        if buffer == "counters":
            return (lo, 0), (hi - lo, NUM_COUNTERS)
        return (lo * n,), ((hi - lo) * n,)


def layout_problems(
    model: DynamicLayout, saved: Mapping[str, tuple[int, ...]], saved_dim: int | None = None, where: str = ""
) -> list[str]:
    """Why a checkpoint's mapping (``buffer -> saved shape``) does not fit ``model``; ``[]`` if it does.

    Names the table and both numbers for each change of capacity, ``num_buckets``,
    candidates per bucket and (given ``saved_dim``) ``embedding_dim``; other buffers
    of the wrong shape or missing are listed by name. ``where`` prefixes each key.
    """
    t = model.table
    head = f"dynamic table '{t}'"
    missing = [b for b in BUFFERS if b not in saved]
    if len(missing) == len(BUFFERS):
        return [
            f"{head}: the checkpoint holds no id mapping for it ('{where}slot_ids', ...): it was saved as a static "
            "table; a static table's checkpoint cannot resume a dynamic one"
        ]
    problems = [f"'{where}{b}': in the model, missing from the checkpoint" for b in missing]
    changed = []
    capacity = saved.get("slot_ids")
    if capacity is not None and len(capacity) == 1 and capacity[0] != model.capacity:
        changed.append(("capacity (num_embeddings)", capacity[0], model.capacity))
    counters = saved.get("counters")
    buckets = counters[0] if counters is not None and len(counters) == 2 else None
    if buckets is not None and buckets != model.num_buckets:
        changed.append(("num_buckets", buckets, model.num_buckets))
    cands = saved.get("cand_ids")
    if cands is not None and len(cands) == 1 and buckets and cands[0] // buckets != model.cands_per_bucket:
        what = "candidates per bucket (candidates_per_bucket; 0 when min_count is 1)"
        changed.append((what, cands[0] // buckets, model.cands_per_bucket))
    if saved_dim is not None and saved_dim != model.dim:
        changed.append(("embedding_dim", saved_dim, model.dim))
    for what, old, new in changed:
        problems.append(
            f"{head}: {what} changed: the checkpoint has {old}, the model {new}; a dynamic table resumes only "
            "with the layout it was saved with"
        )
    if not changed:  # same layout, so every buffer must have its global shape
        for b in BUFFERS:
            if b in saved and tuple(saved[b]) != model.size(b):
                problems.append(f"'{where}{b}': checkpoint has shape {tuple(saved[b])}, model expects {model.size(b)}")
    return problems
