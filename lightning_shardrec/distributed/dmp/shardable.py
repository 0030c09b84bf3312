"""What this library shards, and one collection sharded: the pieces ``DistributedModelParallel``, the TorchRec
sharders' ``shard()`` and ``shard_modules`` all build on.

* :data:`SHARDED`: each shardable collection type -> its sharded type; :func:`find_collections` finds them in a
  model, :func:`table_names` names their tables;
* :func:`default_device`: where sharded tables live when no ``device`` is given (CPU under gloo, this rank's GPU
  under NCCL);
* :func:`shard_collection`: one collection and its table shardings -> the sharded collection, with its fused
  optimizer (what ``EmbeddingBagCollectionSharder().shard(ebc, plan.plan[""], env, device)`` runs).

Sharders reach it only as settings (:class:`~.dmp_settings.SharderSettings`), checked by their caller.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_shardrec.distributed.comm.collectives import ShardingEnv, uses_cuda
from lightning_shardrec.distributed.dmp.dmp_settings import (
    SharderSettings,
    mark_in_backward,
    materialize_meta,
    resolve_comm_precision,
    resolve_fused_config,
)
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.distributed.sharded.embedding import ShardedEmbeddingCollection
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection
from lightning_shardrec.distributed.sharded.plain_embeddings import (
    ShardedPlainEmbedding,
    ShardedPlainEmbeddingBag,
    ShardedPlainMaxEmbeddingBag,
)
from lightning_shardrec.distributed.sharding import KernelSetup
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.kernels import KernelBackend
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.modules.plain_embeddings import PlainEmbedding, PlainEmbeddingBag, PlainMaxEmbeddingBag
from lightning_shardrec.optim import FusedOptimizer
from lightning_shardrec.planner import ParameterSharding

#: each collection type this library shards -> its sharded type
SHARDED: dict[type[nn.Module], type[ShardedCollection]] = {
    EmbeddingBagCollection: ShardedEmbeddingBagCollection,
    EmbeddingCollection: ShardedEmbeddingCollection,
    PlainEmbeddingBag: ShardedPlainEmbeddingBag,
    PlainMaxEmbeddingBag: ShardedPlainMaxEmbeddingBag,
    PlainEmbedding: ShardedPlainEmbedding,
}


def find_collections(module: nn.Module) -> dict[str, nn.Module]:
    """Module path -> every embedding collection this library can shard."""
    return {name: m for name, m in module.named_modules() if type(m) in SHARDED}


def table_names(collection: nn.Module) -> set[str]:
    """Names of a collection's tables, pooled (``embedding_bag_configs``) or sequence."""
    if isinstance(collection, EmbeddingCollection | ShardedEmbeddingCollection):
        return {t.name for t in collection.embedding_configs()}
    return {t.name for t in collection.embedding_bag_configs()}  # type: ignore[operator]


def default_device(env: ShardingEnv) -> torch.device:
    """CPU under gloo; under NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ...) this rank's GPU (:func:`cuda_index`)."""
    if dist.is_initialized() and uses_cuda(env.pg):
        index = cuda_index(torch.cuda.current_device(), os.environ, torch.cuda.device_count())
        return torch.device("cuda", index)
    return torch.device("cpu")


def cuda_index(current: int, environ: Mapping[str, str], count: int) -> int:
    """The GPU of this rank: the current device when set (not 0), else ``LOCAL_RANK`` (torchrun, Lightning,
    SLURM via Lightning), else 0. Without the fallback every rank that never called ``set_device`` lands on GPU 0.
    """
    local = environ.get("LOCAL_RANK", "")
    if current != 0 or not local.isdigit():
        return current
    if count and int(local) >= count:
        raise ValueError(f"default device: LOCAL_RANK {local} but only {count} GPUs are visible; pass device=")
    return int(local)


def shard_collection(
    module: nn.Module,
    params: Mapping[str, ParameterSharding],
    env: ShardingEnv | None = None,
    device: torch.device | str | None = None,
    sharders: Sequence[SharderSettings] = (),
    where: str = "shard",
) -> ShardedCollection:
    """``module`` (a collection) sharded as ``params`` (table name -> sharding) says, on ``env``
    (default: the default process group) and ``device`` (default: CPU under gloo, this rank's GPU under
    NCCL). The fused optimizer comes from ``apply_optimizer_in_backward`` on the tables, else the
    sharders' ``fused_params`` (checked by the caller: ``sharders.check_sharders``), else the default
    (adagrad, lr 0.01)."""
    kind = SHARDED.get(type(module))
    if kind is None:
        valid = ", ".join(sorted(t.__name__ for t in SHARDED))
        raise UnsupportedFeatureError(f"{where}: cannot shard a {type(module).__name__}; shardable: {valid}")
    missing = sorted(table_names(module) - set(params))
    if missing:
        raise ValueError(
            f"{where}: the plan has no entry for table(s) {', '.join(repr(t) for t in missing)} of "
            f"{type(module).__name__}; it has {sorted(params)}"
        )
    env = env if env is not None else ShardingEnv.from_process_group(dist.group.WORLD)
    optim = resolve_fused_config(module, None, sharders, where)
    target = torch.device(device) if device is not None else default_device(env)
    setup = KernelSetup(
        optim=optim,
        backend=KernelBackend.AUTO,
        device=target,
        comm_precision=resolve_comm_precision(None, sharders, where),
    )
    plan = {name: params[name] for name in table_names(module)}
    sharded = kind(module, plan, env, setup)  # type: ignore[arg-type]  # the type matched SHARDED's key
    materialize_meta(sharded, target)
    sharded.to(target)
    sharded.fused_optimizer = FusedOptimizer(sharded.kernels(), optim)  # type: ignore[assignment]
    mark_in_backward({"": sharded}, sharded.fused_optimizer)  # type: ignore[arg-type]
    return sharded


__all__ = [
    "SHARDED",
    "ShardedCollection",
    "cuda_index",
    "default_device",
    "find_collections",
    "shard_collection",
    "table_names",
]
