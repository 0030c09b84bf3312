"""A dynamic-table mapper's figures as one int64 tensor, so ranks can sum them in one collective.

After the sum, :func:`stats_dict` adds two figures derived from the window (the training
lookups since the mappers were built or last started a window): ``miss_rate`` (misses
per lookup, a float) and ``suggested_capacity`` (:func:`suggested_capacity`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_shardrec.configs import BaseEmbeddingConfig
from lightning_shardrec.modules.dynamic.mapper import COUNTERS, WINDOW_FIELDS, DynamicIdMapper

FIELDS = ("occupancy", "capacity", "candidates", *COUNTERS, *WINDOW_FIELDS)
"""The int figures summed over a table's mappers, in this order."""
SAVED = FIELDS[: -len(WINDOW_FIELDS)]
"""The figures a checkpoint restores (a loaded table starts a new window)."""
DERIVED = ("miss_rate", "suggested_capacity")
"""The figures :func:`stats_dict` adds per table after the sum."""
ROUND_TO = 16
"""``suggested_capacity``'s granularity for a table without ``num_buckets``: 16 slots per bucket."""


def mapper_stats(mapper: DynamicIdMapper) -> Tensor:
    """``[len(FIELDS)]`` int64 on the mapper's device: the figures of its buckets (no host sync).

    Every figure is a sum over buckets, so a table's figure is the sum of its mappers'
    (a bucket's ids are its own: the distinct-id estimates of disjoint buckets add up).
    """
    counters = mapper.counters.reshape(-1, len(COUNTERS)).sum(0)  # [5], or per local bucket [W, 5]
    held = torch.stack([(mapper.slot_step >= 0).sum(), (mapper.cand_step >= 0).sum()]).to(counters.device)
    capacity = torch.full((1,), mapper.capacity, dtype=torch.int64, device=counters.device)
    return torch.cat([held[:1], capacity, held[1:], counters, mapper.window_figures().to(counters.device)])


def suggested_capacity(config: BaseEmbeddingConfig, window_ids: int) -> int:
    """The ``num_embeddings`` that would have held a window's ``window_ids`` distinct ids: that many rounded
    up to a multiple of ``config.dynamic.num_buckets`` (the layout needs one), else of :data:`ROUND_TO`;
    never below the table's ``num_embeddings``."""
    step = config.dynamic.num_buckets if config.dynamic is not None and config.dynamic.num_buckets else ROUND_TO
    return max(config.num_embeddings, -(-window_ids // step) * step)


def with_derived(figures: dict[str, int], config: BaseEmbeddingConfig) -> dict[str, float]:
    """``figures`` (:data:`FIELDS`) plus ``miss_rate`` and ``suggested_capacity`` (:data:`DERIVED`)."""
    lookups = figures["window_lookups"]
    out: dict[str, float] = dict(figures)
    out["miss_rate"] = figures["window_misses"] / lookups if lookups else 0.0
    out["suggested_capacity"] = suggested_capacity(config, figures["window_ids"])
    return out


def saved_figures(stats: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``stats`` (``dynamic_stats()``) restricted to :data:`SAVED`: what a resumed table must match."""
    return {table: {k: figures[k] for k in SAVED} for table, figures in stats.items()}


def stats_dict(configs: Sequence[BaseEmbeddingConfig], rows: Tensor) -> dict[str, dict[str, float]]:
    """``rows [len(configs), len(FIELDS)]`` -> ``{table: {figure: value}}`` (:data:`FIELDS` then :data:`DERIVED`)."""
    return {
        c.name: with_derived(dict(zip(FIELDS, row, strict=True)), c)
        for c, row in zip(configs, rows.tolist(), strict=True)
    }
