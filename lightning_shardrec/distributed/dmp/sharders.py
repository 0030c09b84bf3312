"""TorchRec's module sharders: which collection type, its fused optimizer settings, its comm codecs.

Every embedding collection is sharded without a sharder here, so a sharder only *carries
settings* to :class:`~lightning_shardrec.distributed.DistributedModelParallel`, the planner and
``ShardRecStrategy``:

* ``fused_params`` -> the tables' :class:`~lightning_shardrec.configs.FusedOptimConfig`
  (:func:`~lightning_shardrec.distributed.dmp.dmp_settings.sharder_optim`);
* ``qcomm_codecs_registry`` (``get_qcomm_codecs_registry(QCommsConfig(...))``) -> ``comm_precision``;
* ``sharding_types()`` / ``compute_kernels()`` overridden to narrow the choice -> refused
  (say it with ``ParameterConstraints(sharding_types=...)``).

What a sharder sets that would not be honoured raises :class:`UnsupportedFeatureError` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from lightning_shardrec.distributed.dmp.dmp_settings import SHARDERS_SECTION, sharder_comm_precision, sharder_optim
from lightning_shardrec.distributed.dmp.shardable import shard_collection
from lightning_shardrec.distributed.sharded.embedding import ShardedEmbeddingCollection
from lightning_shardrec.distributed.sharded.embeddingbag import ShardedEmbeddingBagCollection
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.planner import EmbeddingComputeKernel, ShardingType
from lightning_shardrec.planner.plans.types import parse_enum

M = TypeVar("M", bound=nn.Module)
#: the order TorchRec's sharders list the types in
_TORCHREC_ORDER = (
    ShardingType.DATA_PARALLEL,
    ShardingType.TABLE_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.ROW_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.GRID_SHARD,
)


class ModuleSharder(Generic[M]):
    """A collection type and the settings to shard it with (TorchRec's ``ModuleSharder``)."""

    def __init__(self, qcomm_codecs_registry: Mapping[str, Any] | None = None) -> None:
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @property
    def module_type(self) -> type[M]:
        raise NotImplementedError(f"{type(self).__name__} must define module_type")

    @property
    def qcomm_codecs_registry(self) -> Mapping[str, Any] | None:
        return self._qcomm_codecs_registry

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        """Table name -> weight of ``module``'s tables."""
        return {n.split(".")[-2]: p for n, p in module.named_parameters() if n.endswith(".weight")}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Every sharding type runs on every device here (TorchRec's order; TorchRec offers only
        data/table/column-wise on CPU, and ``table_column_wise``, which is not supported here)."""
        return [t.value for t in _TORCHREC_ORDER]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """``["dense"]`` for ``data_parallel``, else ``["fused"]`` (TorchRec's CPU answer; its UVM,
        caching and key-value kernels do not exist here)."""
        kind = parse_enum(ShardingType, sharding_type, "sharding type")
        return [EmbeddingComputeKernel.DENSE.value if kind is ShardingType.DATA_PARALLEL else "fused"]

    # --- TorchRec's remaining sharder methods (issue 43) ------------------------------------
    def storage_usage(self, tensor: Tensor, compute_device_type: str, compute_kernel: str) -> dict[str, int]:
        """Bytes ``tensor`` takes where its kernel keeps it: ``{"hbm": n}`` on GPUs, ``{"ddr": n}`` on CPU."""
        where = "hbm" if compute_device_type in ("cuda", "mtia") else "ddr"
        return {where: tensor.element_size() * tensor.nelement()}

    def shard(
        self,
        module: M,
        params: Mapping[str, Any],
        env: Any = None,
        device: torch.device | str | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        """``module`` sharded as ``params`` (table name -> ``ParameterSharding``, e.g. ``plan.plan[""]``) on
        ``env`` and ``device``, with this sharder's ``fused_params`` and comm codecs; the result's
        ``fused_optimizer`` steps its tables inside backward. ``module_fqn`` only names it in errors."""
        if not isinstance(module, self.module_type):
            raise TypeError(
                f"{type(self).__name__}.shard: expects a {self.module_type.__name__}, got {type(module).__name__}"
            )
        where = f"{type(self).__name__}.shard" + (f" ('{module_fqn}')" if module_fqn else "")
        return shard_collection(module, params, env, device, check_sharders([self], where), where)


class BaseEmbeddingSharder(ModuleSharder[M]):
    """``BaseEmbeddingSharder(fused_params=None, qcomm_codecs_registry=None)``."""

    def __init__(
        self, fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        self._fused_params = dict(fused_params) if fused_params is not None else None

    @property
    def fused_params(self) -> dict[str, Any] | None:
        return self._fused_params


class EmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """Settings for every :class:`EmbeddingBagCollection` of the model."""

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[nn.Module]:
        return ShardedEmbeddingBagCollection


class EmbeddingCollectionSharder(BaseEmbeddingSharder[EmbeddingCollection]):
    """Settings for every :class:`EmbeddingCollection` of the model."""

    @property
    def module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> type[nn.Module]:
        return ShardedEmbeddingCollection


def check_sharders(sharders: Sequence[object] | None, where: str) -> list[ModuleSharder[Any]]:
    """``sharders`` as a list, refusing what this library would not honour (named)."""
    out: list[ModuleSharder[Any]] = []
    seen: dict[type, str] = {}
    for i, s in enumerate(sharders or []):
        if not isinstance(s, ModuleSharder):
            raise UnsupportedFeatureError(
                f"{where}: sharders[{i}] is {type(s).__name__}; use EmbeddingBagCollectionSharder or "
                f"EmbeddingCollectionSharder from lightning_shardrec.distributed ({SHARDERS_SECTION})"
            )
        kind = s.module_type
        if kind in seen:
            raise ValueError(f"{where}: two sharders for {kind.__name__} ({seen[kind]} and {type(s).__name__})")
        seen[kind] = type(s).__name__
        base = ModuleSharder
        for method in ("sharding_types", "compute_kernels", "shard"):
            if getattr(type(s), method, None) is not getattr(base, method, None):
                raise UnsupportedFeatureError(
                    f"{where}: {type(s).__name__}.{method}() is overridden; sharders do not choose sharding here. "
                    f"Use ParameterConstraints(sharding_types=[...]) for the tables ({SHARDERS_SECTION})"
                )
        out.append(s)
    return out


def get_default_sharders() -> list[ModuleSharder[Any]]:
    """A sharder per collection type this library shards (TorchRec's list, for what exists here)."""
    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


def get_module_to_default_sharders() -> dict[type[nn.Module], ModuleSharder[Any]]:
    return {s.module_type: s for s in get_default_sharders()}


__all__ = [
    "BaseEmbeddingSharder",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "ModuleSharder",
    "check_sharders",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "sharder_comm_precision",
    "sharder_optim",
]
