"""A dynamic-table mapper's figures as one int64 tensor, so ranks can sum them in one collective."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.modules.dynamic.mapper import COUNTERS, DynamicIdMapper

FIELDS = ("occupancy", "capacity", "candidates", *COUNTERS)
"""The figures ``dynamic_stats()`` reports per table, in this order (ints)."""


def mapper_stats(mapper: DynamicIdMapper) -> Tensor:
    """``[len(FIELDS)]`` int64 on the mapper's device: the figures of its buckets (no host sync).

    Every figure is a sum over buckets, so a table's figure is the sum of its mappers'.
    """
    counters = mapper.counters.reshape(-1, len(COUNTERS)).sum(0)  # [5], or per local bucket [W, 5]
    held = torch.stack([(mapper.slot_step >= 0).sum(), (mapper.cand_step >= 0).sum()]).to(counters.device)
    capacity = torch.full((1,), mapper.capacity, dtype=torch.int64, device=counters.device)
    return torch.cat([held[:1], capacity, held[1:], counters])


def stats_dict(names: list[str], rows: Tensor) -> dict[str, dict[str, int]]:
    """``rows [len(names), len(FIELDS)]`` -> ``{table: {figure: int}}``."""
    return {name: dict(zip(FIELDS, row, strict=True)) for name, row in zip(names, rows.tolist(), strict=True)}
