"""Dynamic-table counters of a whole model, summed over ranks for sharded collections.

A sharded collection's rank holds the mappers of the buckets it owns
(``dynamic_mappers()``); every counter is a sum over buckets, so the table's figure is
the sum over ranks of each rank's mappers (``capacity`` too: each rank counts its
slots). ``ShardedCollection.dynamic_stats()`` does that with one ``all_reduce`` of an
int64 ``[tables, figures]`` tensor, tables in the collection's config order (the same
on every rank, whether or not a rank holds buckets of a table): a collective every
rank of the collection's process group must call, at the same point. Unsharded
collections answer from their own mappers (no communication).
"""

from __future__ import annotations

from torch import nn

from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.modules.dynamic.tables import HasDynamicTables


def dynamic_stats(module: nn.Module, new_window: bool = False) -> dict[str, dict[str, float]]:
    """Per dynamic table of every collection in ``module``: occupancy, capacity, ... (ints,
    :data:`~lightning_shardrec.modules.dynamic.stats.FIELDS`), then ``miss_rate`` (a float) and
    ``suggested_capacity`` of the window: the training lookups since the tables were built or since the
    last call with ``new_window=True``, which then starts a new one.

    Keyed by table name (``<collection path>.<table>`` for a name an earlier
    collection already used). A collective when ``module`` holds sharded collections:
    call it on every rank at the same point.
    """
    out: dict[str, dict[str, float]] = {}
    for path, sub in module.named_modules():
        if not isinstance(sub, (ShardedCollection, HasDynamicTables)):
            continue
        for table, figures in sub.dynamic_stats(new_window).items():
            out[table if table not in out else f"{path}.{table}"] = figures
    return out


def has_dynamic_tables(module: nn.Module) -> bool:
    """Whether any collection in ``module`` (sharded or not) has a dynamic table."""
    for sub in module.modules():
        if isinstance(sub, ShardedCollection) and any(t.dynamic is not None for t in sub.table_configs()):
            return True
        if isinstance(sub, HasDynamicTables) and sub.dynamic_tables is not None:
            return True
    return False


def full_table_warnings(stats: dict[str, dict[str, float]], threshold: float, steps: int | None = None) -> list[str]:
    """One message per table of :func:`dynamic_stats` ``stats`` whose window ``miss_rate`` exceeds
    ``threshold`` (a share of its lookups), naming its capacity, occupancy, miss rate and the capacity
    that would have held the window's ids (``steps``: the window's length, for the message)."""
    out = []
    over = f" over the last {steps} steps" if steps else ""
    for table, f in stats.items():
        if f["window_lookups"] and f["miss_rate"] > threshold:
            cap, occ = int(f["capacity"]), int(f["occupancy"])
            out.append(
                f"dynamic table '{table}' is full: {int(f['window_misses'])} of its {int(f['window_lookups'])} "
                f"lookups{over} missed (miss rate {f['miss_rate']:.1%}, threshold {threshold:.0%}); capacity "
                f"{cap}, occupancy {occ} ({occ / max(cap, 1):.0%}). The window saw about {int(f['window_ids'])} "
                f"distinct ids: num_embeddings={int(f['suggested_capacity'])} would have held them "
                "(docs/dynamic-tables.md, 'A full table')"
            )
    return out
