"""After fit, rank 0 holds the full tables when they fit: ``model.state_dict()`` and ``model(batch)`` there work.

What DDP users do after ``trainer.fit``::

    if trainer.is_global_zero:
        torch.save(model.state_dict(), "model.pt")
        scores = model(batch)

A gather needs every rank, and on rank 0 alone the other ranks are gone (or elsewhere): a gather
on first use there is impossible (it would wait for ranks that never join). So at the end of
every fit (``on_train_end``, every rank still together) the strategy gathers the full tables to
rank 0 (:func:`~lightning_shardrec.checkpoint.full_gather.gather_full_state` with ``dst=0``:
banded tensor collectives), per ``ShardRecStrategy(full_tables_after_fit=...)``:

* ``None`` (the default): when the tables take at most :data:`AUTO_BYTES` (64 MiB) and fit in
  :data:`SHARE` of rank 0's available host memory. Larger tables stay sharded (each rank holds
  its share; ``tests/lightning/test_strategy_memory.py``), and no collective runs for them;
* ``True``: whenever they fit in :data:`SHARE` of rank 0's available host memory;
* ``False``: never.

Rank 0's ``model.state_dict()`` then holds them under the unsharded names
(:class:`~lightning_shardrec.lightning.training.guards.ShardedGuard`), and a forward of a sharded module
outside the loops on rank 0 alone runs its unsharded twin over those tables (:func:`replica`,
built on first use, on the inputs' device): an ``EmbeddingBagCollection`` or
``EmbeddingCollection`` (static or dynamic tables) of the same configs, or the ``nn.Embedding`` /
``nn.EmbeddingBag`` the strategy swapped, with the user's call. The copy is dropped when the next
fit starts. Cost: one gather of every table at the end of each fit, and the tables' bytes in rank
0's host memory until the next fit. Where they were not gathered, ``state_dict()`` raises
``ShardedStateError`` and a lone forward ``CollectiveCallError``, each with the reason (the
arithmetic) and the collective alternatives (``trainer.strategy.full_state_dict()`` on every
rank, ``trainer.save_checkpoint``, ``trainer.predict``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shardrec.checkpoint.full_gather import gather_full_state
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.distributed.sharded.embedding import ShardedEmbeddingCollection
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection
from lightning_shardrec.lightning.training.guards import ShardedGuard
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.modules.dynamic.tables import DynamicTables
from lightning_shardrec.modules.plain_embeddings import PlainSpec
from lightning_shardrec.sparse import KeyedJaggedTensor

#: the largest share of rank 0's available host memory the gathered tables may take
SHARE = 0.25
#: by default (``full_tables_after_fit=None``) only tables of at most this many bytes are gathered
AUTO_BYTES = 64 * 1024**2
_GIB, _MIB = 1024**3, 1024**2


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


def over_default(need: int) -> str:
    """Why tables of ``need`` bytes are not gathered by default ("" when they are small enough)."""
    if need <= AUTO_BYTES:
        return ""
    return (
        f"the full tables need {need / _MIB:.1f} MiB, over the {AUTO_BYTES / _MIB:.0f} MiB gathered to rank 0 by "
        "default, so each rank kept only its share; ShardRecStrategy(full_tables_after_fit=True) gathers them at the "
        f"end of fit when they fit in {SHARE:.0%} of rank 0's available host memory"
    )


def gather_to_rank_zero(
    sharded: Mapping[str, ShardedCollection],
    guard: ShardedGuard,
    control: dist.ProcessGroup | None = None,
    always: bool = True,
) -> None:
    """Collective (every rank, at the end of fit): rank 0 keeps the full tables when they fit.

    Rank 0's decision is a CPU flag on ``control`` (the strategy's gloo control group,
    :mod:`lightning_shardrec.lightning.training.control`; the default group when None). ``always`` False
    (the default mode): only tables of at most :data:`AUTO_BYTES` (decided on every rank alike
    from the configs, with no collective when they are larger).
    """
    guard.drop_full()
    need = table_bytes(sharded)
    if not always and over_default(need):
        guard.full_refused = over_default(need)
        return
    rank = dist.get_rank()
    ok, why = fits(need, available_bytes() if rank == 0 else None)
    flag = torch.tensor([int(ok)], dtype=torch.int64)  # on the host: a control message
    dist.broadcast(flag, src=dist.get_global_rank(control, 0) if control is not None else 0, group=control)
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
        if _has_replica(coll):
            guard.replicas[path] = _local_forward(coll, guard, path)


def _has_replica(coll: ShardedCollection) -> bool:
    return isinstance(coll, ShardedEmbeddingBagCollection | ShardedEmbeddingCollection)


def replica(coll: ShardedCollection, full: dict[str, Tensor]) -> nn.Module:
    """The unsharded twin of ``coll`` over its full tables ``full`` (its state dict), with the same call.

    A swapped ``nn.Embedding`` / ``nn.EmbeddingBag`` becomes that torch module again (its mode,
    ``padding_idx``, ``include_last_offset``); a collection, the library's collection of the same
    table configs (dynamic tables with their id mappings).
    """
    spec = getattr(coll, "spec", None)
    if isinstance(spec, PlainSpec):
        weight = full["weight"]
        if spec.kind == "Embedding":
            return nn.Embedding.from_pretrained(weight, freeze=False, padding_idx=spec.padding_idx)
        return nn.EmbeddingBag.from_pretrained(
            weight,
            freeze=False,
            mode=spec.mode,
            padding_idx=spec.padding_idx,
            include_last_offset=spec.include_last_offset,
        )
    module: nn.Module
    with torch.random.fork_rng(devices=[]):  # building a collection draws table seeds: not from the user's RNG
        if isinstance(coll, ShardedEmbeddingBagCollection):
            meta = torch.device("meta")
            tables = coll.embedding_bag_configs()
            module = EmbeddingBagCollection(tables=tables, is_weighted=coll.is_weighted(), device=meta)
        elif isinstance(coll, ShardedEmbeddingCollection):
            need, check = coll.need_indices(), coll.validate_ids
            module = EmbeddingCollection(coll.table_configs(), "meta", need, validate_ids=check)  # type: ignore[arg-type]
        else:
            raise TypeError(f"no unsharded twin for {type(coll).__name__}")
    if getattr(module, "dynamic_tables", None) is not None:  # id mappings on the host: loaded, or (the
        # buffers a state dict does not hold) as they start; the weights stay on meta until assigned
        module.dynamic_tables = DynamicTables(coll.table_configs(), "cpu")
    module.load_state_dict(full, assign=True)
    return module


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    first = args[0] if args else next(iter(kwargs.values()))
    return first.device() if isinstance(first, KeyedJaggedTensor) else first.device


def _local_forward(coll: ShardedCollection, guard: ShardedGuard, path: str) -> Callable[..., Any]:
    """Rank 0, after fit: a forward outside the loops runs the unsharded twin over the full tables
    (built on first use, on the inputs' device; the sharded forward everywhere else)."""
    sharded_forward = type(coll).forward
    plain: list[nn.Module] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not guard.alone(path):
            return sharded_forward(coll, *args, **kwargs)
        if not plain:
            plain.append(replica(coll, guard.full[path]))
        plain[0].to(_device_of(args, kwargs))
        return plain[0](*args, **kwargs)

    coll.forward = forward  # type: ignore[method-assign]  # removed when the copy is dropped (next fit)
    return forward
