"""TorchRec's ``torchrec.distributed.embeddingbag``: the sharded pooled collection and its sharder, at TorchRec's
path.

Defined in :mod:`lightning_shardrec.distributed.sharded.embeddingbag` and
:mod:`lightning_shardrec.distributed.dmp.sharders`.
"""

from lightning_shardrec.distributed.dmp.sharders import EmbeddingBagCollectionSharder
from lightning_shardrec.distributed.sharded.embeddingbag import *  # noqa: F403  (every name the module had here)
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection

__all__ = ["EmbeddingBagCollectionSharder", "ShardedEmbeddingBagCollection"]
