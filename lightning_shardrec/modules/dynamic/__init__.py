"""Dynamic tables: raw ids mapped to a fixed number of rows, admitted and evicted as they come.

``hashing`` (an id's bucket), ``mapper`` (one table's id -> slot map, :class:`DynamicIdMapper`),
``slots`` (the vectorised algorithm over flat bucket state), ``mapper_group`` (several tables
mapped in one pass), ``native`` (the compiled CPU loops, built with the package), ``ops`` (those loops
as ``torch.library`` custom ops), ``layout`` (the mapping as
checkpoints hold it), ``stats`` (a mapper's figures) and ``tables`` (what an unsharded
collection does for its dynamic tables).
"""

from lightning_shardrec.modules.dynamic.hashing import bucket_of
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper, LookupResult
from lightning_shardrec.modules.dynamic.tables import DynamicTables, optimizer_reset_hook, reset_optimizer_rows

__all__ = [
    "DynamicIdMapper",
    "DynamicTables",
    "LookupResult",
    "bucket_of",
    "optimizer_reset_hook",
    "reset_optimizer_rows",
]
