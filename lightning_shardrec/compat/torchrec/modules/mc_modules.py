"""TorchRec's managed-collision modules' path (``torchrec.modules.mc_modules``): not provided, with why.

TorchRec's eviction policies score every id of the whole table at each eviction interval
(``DistanceLFU_EvictionPolicy``: ``count / (iterations since last access) ** decay_exponent``;
``LFU_EvictionPolicy``: count; ``LRU_EvictionPolicy``: recency) and evict the lowest-scored in one batch.
The dynamic tables here evict inside a fixed bucket of the id's hash, at the moment a new id finds the
bucket full, least recently (``"lru"``) or least often (``"lfu"``, ties by recency) seen, with no decay;
so none of TorchRec's rules maps onto them, and each name is refused, pointing at the nearest choice.
"""

from __future__ import annotations

from lightning_shardrec.errors import missing_names

_USE = (
    "TorchRec's whole-table, interval-scored eviction does not map onto the per-bucket eviction here; "
    "use EmbeddingBagConfig(..., dynamic=DynamicConfig(eviction='lfu' or 'lru', ttl_steps=...))"
)
__getattr__ = missing_names(
    __name__,
    {
        "DistanceLFU_EvictionPolicy": f"its score count / distance**decay_exponent has no counterpart: {_USE}",
        "LFU_EvictionPolicy": _USE,
        "LRU_EvictionPolicy": _USE,
        "MCHManagedCollisionModule": _USE,
        "ManagedCollisionCollection": _USE,
        "ManagedCollisionModule": _USE,
    },
)
