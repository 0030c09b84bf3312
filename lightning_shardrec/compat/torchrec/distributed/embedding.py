"""TorchRec's ``torchrec.distributed.embedding``: the sharded sequence collection and its sharder, at TorchRec's path.

Defined in :mod:`lightning_shardrec.distributed.sharded.embedding` and
:mod:`lightning_shardrec.distributed.dmp.sharders`.
"""

from lightning_shardrec.distributed.dmp.sharders import EmbeddingCollectionSharder
from lightning_shardrec.distributed.sharded.embedding import *  # noqa: F403  (every name the module had here)
from lightning_shardrec.distributed.sharded.embedding import ShardedEmbeddingCollection

__all__ = ["EmbeddingCollectionSharder", "ShardedEmbeddingCollection"]
