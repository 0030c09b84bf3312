"""What an unsharded collection does for its dynamic tables.

:class:`DynamicTables` holds one :class:`DynamicIdMapper` per dynamic table (its
buffers land in the collection's state dict under ``dynamic_tables.<table>.``),
maps raw ids to slots before the lookup, resets new slots to their deterministic
init in place and tells the registered reset hooks (e.g. an optimizer, through
:func:`optimizer_reset_hook`) which rows were reset.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_shardrec.configs import BaseEmbeddingConfig, UniformInit
from lightning_shardrec.modules.dynamic.hashing import mix64
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper, LookupResult
from lightning_shardrec.modules.dynamic.stats import mapper_stats, stats_dict
from lightning_shardrec.modules.features import check_ids
from lightning_shardrec.modules.table_dict import TableDict
from lightning_shardrec.modules.table_init import uniform_rows
from lightning_shardrec.sparse import KeyedJaggedTensor

ResetHook = Callable[[str, Tensor, Tensor], None]
"""``hook(table_name, weight, slots)``: rows ``slots`` of ``weight`` were just reset."""


def _seed_base(table: BaseEmbeddingConfig) -> int:
    seed = 0 if table.dynamic is None else table.dynamic.seed
    return zlib.crc32(table.name.encode()) | (seed << 32)


def row_seeds(table: BaseEmbeddingConfig, slots: Tensor, generations: Tensor) -> Tensor:
    """One int64 seed per (table, slot, generation): the same on every rank and device."""
    return mix64(mix64(slots.long() + _seed_base(table)) ^ generations.long())


def _uniform_bounds(table: BaseEmbeddingConfig) -> tuple[float, float] | None:
    """The uniform range of a table's new rows, None for a custom ``init_fn``."""
    if table.init_fn is None:
        return table.init_range()
    if isinstance(table.init_fn, UniformInit):
        return table.init_fn.low, table.init_fn.high
    return None


def fresh_seeds(
    tables: Sequence[BaseEmbeddingConfig], which: Tensor, slots: Tensor, generations: Tensor
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(row seeds, lows, highs)``, ``[M]`` each, of the fresh rows of slot ``slots[i]`` of table
    ``tables[which[i]]``: :func:`~lightning_shardrec.modules.table_init.uniform_rows` of them is,
    row for row, what :func:`fresh_rows` gives each table. None when a table has a custom ``init_fn``."""
    bounds = [_uniform_bounds(t) for t in tables]
    if any(b is None for b in bounds):
        return None
    device = slots.device
    # made on the host, copied without waiting (a blocking copy would be a host sync on CUDA)
    base = torch.tensor([_seed_base(t) for t in tables], dtype=torch.int64).to(device, non_blocking=True)
    seeds = mix64(mix64(slots.long() + base.index_select(0, which)) ^ generations.long())
    lows, highs = (
        torch.tensor(v, dtype=torch.float64).to(device, non_blocking=True).index_select(0, which)
        for v in zip(*bounds, strict=True)  # type: ignore[misc]  # no None left
    )
    return seeds, lows, highs


def fresh_rows(table: BaseEmbeddingConfig, slots: Tensor, generations: Tensor, weight: Tensor) -> Tensor:
    """``[len(slots), dim]`` fresh rows for ``slots``, a function of (table, slot, generation) only.

    The table's uniform ``init_range`` is drawn from a counter-based hash (vectorised);
    a custom ``init_fn`` is called once per row, on CPU, with the RNG seeded per row.
    """
    seeds = row_seeds(table, slots, generations)
    dim, bounds = weight.shape[1], _uniform_bounds(table)
    if bounds is not None:
        return uniform_rows(seeds, dim, *bounds, weight.dtype)  # as a static table's rows (modules.table_init)
    rows = torch.empty(len(slots), dim, dtype=weight.dtype)
    init = table.init_fn
    assert init is not None  # a table without one has uniform bounds
    with torch.random.fork_rng(devices=[]):
        for i, s in enumerate(seeds.tolist()):  # custom init: one call per new row
            torch.manual_seed(s & 0x7FFF_FFFF_FFFF_FFFF)
            init(rows[i : i + 1])
    return rows.to(weight.device)


def reset_optimizer_rows(optimizer: torch.optim.Optimizer, weight: Tensor, slots: Tensor) -> None:
    """Reset rows ``slots`` of ``weight``'s state in a torch optimizer (before its next step).

    Every state tensor shaped like ``weight`` has those rows reset: Adagrad's ``sum``
    to its ``initial_accumulator_value``, anything else (Adam moments, SGD momentum)
    to zero. Per-parameter scalars (Adam's ``step``) are shared by all rows and kept.
    """
    state = optimizer.state.get(weight)
    if not state or slots.numel() == 0:
        return
    group = next((g for g in optimizer.param_groups if any(p is weight for p in g["params"])), {})
    with torch.no_grad():
        for name, value in state.items():
            if isinstance(value, Tensor) and value.shape == weight.shape:
                fill = float(group.get("initial_accumulator_value", 0.0)) if name == "sum" else 0.0
                value[slots.to(value.device)] = fill


def optimizer_reset_hook(optimizer: torch.optim.Optimizer) -> ResetHook:
    """A reset hook that resets the optimizer state rows of reset slots."""

    def hook(table: str, weight: Tensor, slots: Tensor) -> None:
        reset_optimizer_rows(optimizer, weight, slots)

    return hook


class DynamicTables(TableDict):  # any table name (modules.table_dict)
    """The id mappers of a collection's dynamic tables, keyed by table name."""

    def __init__(self, tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None) -> None:
        super().__init__(
            {
                t.name: DynamicIdMapper(t.name, t.dynamic, t.num_embeddings, device=device)
                for t in tables
                if t.dynamic is not None
            }
        )
        self._configs = {t.name: t for t in tables}
        self._hooks: OrderedDict[int, ResetHook] = OrderedDict()

    def register_reset_hook(self, hook: ResetHook) -> RemovableHandle:
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def mapper(self, table: str) -> DynamicIdMapper:
        mapper = self[table]
        assert isinstance(mapper, DynamicIdMapper)  # internal invariant, not user input
        return mapper

    def stats(self, new_window: bool = False) -> dict[str, dict[str, float]]:
        """Per table: :data:`~lightning_shardrec.modules.dynamic.stats.FIELDS` and ``DERIVED`` (then, given
        ``new_window``, every mapper starts a new window)."""
        names = list(self.keys())
        if not names:
            return {}
        rows = torch.stack([mapper_stats(self.mapper(n)).cpu() for n in names])
        if new_window:
            for n in names:
                self.mapper(n).new_window()
        return stats_dict([self._configs[n] for n in names], rows)

    def slots(self, table: str, ids: Tensor, weight: Tensor, train: bool) -> Tensor:
        """Slots of raw ``ids`` (``-1``: not admitted); new slots are reset in ``weight`` first."""
        result: LookupResult = self.mapper(table).map(ids, train)
        if result.new_slots.numel():
            config = self._configs[table]
            with torch.no_grad():
                weight[result.new_slots] = fresh_rows(config, result.new_slots, result.new_generations, weight)
            for hook in self._hooks.values():
                hook(table, weight, result.new_slots)
        return result.slots

    def bags(
        self, table: str, ids: Tensor, lengths: Tensor, weights: Tensor | None, weight: Tensor, train: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(slots, offsets, per-id weights)`` of bags of raw ids, not-admitted ids dropped."""
        slots = self.slots(table, ids, weight, train)
        keep = slots >= 0
        if bool(keep.all()):
            return slots, _offsets(lengths), weights
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths.long())
        kept = torch.bincount(bag[keep], minlength=lengths.numel())
        return slots[keep], _offsets(kept), None if weights is None else weights[keep]

    def check_static_ids(
        self, features: KeyedJaggedTensor, tables: Sequence[BaseEmbeddingConfig], rows: list[int], names: list[str]
    ) -> None:
        """:func:`check_ids` for the static tables only (a dynamic table takes any int64 id)."""
        keep = [i for i, t in enumerate(tables) for _ in t.feature_names]
        static = [k for k, i in enumerate(keep) if tables[i].dynamic is None]
        if static:
            check_ids(features.permute(static), [rows[k] for k in static], [names[k] for k in static])


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).long()


class HasDynamicTables:
    """The collections' surface for their dynamic tables (mixed into EBC and EC)."""

    dynamic_tables: DynamicTables | None

    def _make_dynamic_tables(self, tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None) -> None:
        dynamic = any(t.dynamic is not None for t in tables)
        self.dynamic_tables = DynamicTables(tables, device) if dynamic else None

    def register_reset_hook(self, hook: ResetHook) -> None:
        """Call ``hook(table, weight, slots)`` whenever rows of a dynamic table are reset."""
        if self.dynamic_tables is not None:
            self.dynamic_tables.register_reset_hook(hook)

    def dynamic_stats(self, new_window: bool = False) -> dict[str, dict[str, float]]:
        """Per dynamic table: occupancy, capacity, admissions, evictions, misses, ..., the window's figures
        and ``miss_rate``, ``suggested_capacity`` (``modules.dynamic.stats``); ``new_window``: then start a
        new window."""
        return {} if self.dynamic_tables is None else self.dynamic_tables.stats(new_window)
