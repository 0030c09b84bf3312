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

from lightning_shardrec.distributed.collection import ShardedCollection
from lightning_shardrec.modules.dynamic.tables import HasDynamicTables


def dynamic_stats(module: nn.Module) -> dict[str, dict[str, int]]:
    """Per dynamic table of every collection in ``module``: occupancy, capacity, ... (ints,
    :data:`~lightning_shardrec.modules.dynamic.stats.FIELDS`).

    Keyed by table name (``<collection path>.<table>`` for a name an earlier
    collection already used). A collective when ``module`` holds sharded collections:
    call it on every rank at the same point.
    """
    out: dict[str, dict[str, int]] = {}
    for path, sub in module.named_modules():
        if not isinstance(sub, (ShardedCollection, HasDynamicTables)):
            continue
        for table, figures in sub.dynamic_stats().items():
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
