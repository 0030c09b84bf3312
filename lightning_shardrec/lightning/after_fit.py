"""After fit, rank 0 holds the full tables when they fit: ``torch.save(model.state_dict())`` there works.

What DDP users do after ``trainer.fit``::

    if trainer.is_global_zero:
        torch.save(model.state_dict(), "model.pt")

A gather needs every rank, and on rank 0 alone the other ranks are gone (or elsewhere). So at
the end of every fit (``on_train_end``, every rank still together) the strategy gathers the
full tables to rank 0 (:func:`~lightning_shardrec.checkpoint.full_gather.gather_full_state`
with ``dst=0``: banded tensor collectives) when they fit: their bytes at most
:data:`SHARE` of the host memory available on rank 0 (checked on rank 0, agreed by every
rank). Rank 0's ``model.state_dict()`` then holds them under the unsharded names
(:class:`~lightning_shardrec.lightning.guards.ShardedGuard`); the copy is dropped when the next
fit starts. On rank 0, a forward outside the loops (``model(batch)`` after fit, rank 0 alone) of
a sharded ``EmbeddingBagCollection`` runs a plain collection over those tables (built on first
use, on the batch's device); other collections, and other ranks, still refuse a lone forward
with ``CollectiveCallError`` naming ``trainer.predict``. Cost: one gather of every table at the
end of each fit, and the tables' bytes in rank 0's host memory until the next fit. Where they do
not fit, ``state_dict()`` raises ``ShardedStateError`` with the arithmetic and the collective
alternatives (``trainer.strategy.full_state_dict()`` on every rank, ``trainer.save_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_shardrec.checkpoint.full_gather import gather_full_state
from lightning_shardrec.configs import EmbeddingBagConfig
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection
from lightning_shardrec.lightning.guards import ShardedGuard
from lightning_shardrec.modules import EmbeddingBagCollection
from lightning_shardrec.sparse import KeyedJaggedTensor

#: the largest share of rank 0's available host memory the gathered tables may take
SHARE = 0.25
_GIB = 1024**3


def table_bytes(sharded: Mapping[str, ShardedCollection]) -> int:
    """The full tables' bytes (fp32 rows of every table of every collection)."""
    return sum(c.num_embeddings * c.embedding_dim * 4 for s in sharded.values() for c in s.table_configs())


def available_bytes() -> int | None:
    """Host memory available now (Linux ``/proc/meminfo``'s MemAvailable; None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fits(need: int, available: int | None) -> tuple[bool, str]:
    """Whether ``need`` bytes fit in :data:`SHARE` of ``available``, and the arithmetic either way."""
    if available is None:
        return False, "rank 0's available host memory is unknown on this system, so the tables were not gathered"
    verdict = "fit" if need <= SHARE * available else "do not fit"
    return need <= SHARE * available, (
        f"the full tables need {need / _GIB:.2f} GiB and {verdict} in {SHARE:.0%} of rank 0's "
        f"{available / _GIB:.1f} GiB available host memory"
    )


def gather_to_rank_zero(sharded: Mapping[str, ShardedCollection], guard: ShardedGuard, device: torch.device) -> None:
    """Collective (every rank, at the end of fit): rank 0 keeps the full tables when they fit."""
    guard.drop_full()
    rank = dist.get_rank()
    ok, why = fits(table_bytes(sharded), available_bytes() if rank == 0 else None)
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, src=0)  # rank 0 decides (its memory)
    reason = why if rank == 0 else "the full tables are held only on rank 0 after a fit"
    if not int(flag.item()):
        guard.full_refused = reason
        return
    weights, _ = gather_full_state(sharded, dst=0)
    guard.full_refused = reason
    if rank != 0:
        return
    for path, coll in sharded.items():
        prefix = f"{path}." if path else ""
        guard.full[path] = {k[len(prefix) :]: t for k, t in weights.items() if k.startswith(prefix)}
        if isinstance(coll, ShardedEmbeddingBagCollection) and not any(c.dynamic for c in coll.table_configs()):
            guard.replicas[path] = _local_forward(coll, guard, path)


def _local_forward(coll: ShardedEmbeddingBagCollection, guard: ShardedGuard, path: str) -> Callable[..., Any]:
    """Rank 0, after fit: a forward outside the loops runs a plain collection over the full tables
    (built on first use, on the inputs' device; the sharded forward everywhere else)."""
    sharded_forward = type(coll).forward
    plain: list[torch.nn.Module] = []

    def forward(features: KeyedJaggedTensor) -> Any:
        if not guard.alone(path):
            return sharded_forward(coll, features)
        if not plain:
            tables = cast(list[EmbeddingBagConfig], coll.table_configs())
            module = EmbeddingBagCollection(tables=tables, is_weighted=coll.is_weighted(), device="meta")
            module.load_state_dict(guard.full[path], assign=True)
            plain.append(module)
        plain[0].to(features.device())
        return plain[0](features)

    coll.forward = forward  # type: ignore[method-assign]  # removed when the copy is dropped (next fit)
    return forward
