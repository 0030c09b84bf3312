"""TorchRec's ``DistributedModelParallel`` arguments resolved into this library's settings.

* the fused optimizer of the tables: ``embedding_optimizer=``, else each table's
  ``apply_optimizer_in_backward`` class and kwargs, else its sharder's ``fused_params``,
  else adagrad (lr 0.01); tables that would train differently are refused by name
  (one fused optimizer per model); a table with none of these takes the others' (or is
  ``data_parallel``, stepped by the dense optimizer, as under TorchRec);
* the wire precision: ``comm_precision=``, else the sharders' ``qcomm_codecs_registry``;
* a sharder is read here only as the settings it carries (:class:`SharderSettings`: :func:`sharder_optim`,
  :func:`sharder_comm_precision`); :mod:`.sharders` defines TorchRec's sharder classes on top of this;
* ``env=``: its process group (a ``ShardingEnv.from_local`` env uses the default group when
  one is initialised with that world size);
* ``init_parameters=True``: dense parameters left on ``meta`` are allocated and reset.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shardrec.configs import EmbOptimType, FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.fbgemm_qcomm_codec import QCommsRegistry
from lightning_shardrec.distributed.comm.qcomm import CommPrecision, WirePrecision, parse_wire
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.modules.plain_embeddings import PlainEmbedding, PlainEmbeddingBag, PlainMaxEmbeddingBag
from lightning_shardrec.optim.fused_settings import config_of_fused_params, in_backward_config
from lightning_shardrec.planner import EmbeddingComputeKernel, ParameterConstraints

_COLLECTIONS = (EmbeddingBagCollection, EmbeddingCollection, PlainEmbeddingBag, PlainMaxEmbeddingBag, PlainEmbedding)
#: where the errors about sharders send the reader
SHARDERS_SECTION = "see docs/migrating.md, 'Sharders'"


class SharderSettings(Protocol):
    """What a module sharder (:class:`~.sharders.ModuleSharder`) carries here: the collection type it is for and
    its comm codecs; ``fused_params`` where it has them (read with ``getattr``)."""

    @property
    def module_type(self) -> type[nn.Module]: ...

    @property
    def qcomm_codecs_registry(self) -> Mapping[str, Any] | None: ...


def sharder_optim(
    sharders: Sequence[SharderSettings], base: FusedOptimConfig, where: str
) -> dict[type, FusedOptimConfig]:
    """Collection type -> fused config its sharder's ``fused_params`` give (types without one: absent)."""
    out: dict[type, FusedOptimConfig] = {}
    for s in sharders:
        params = getattr(s, "fused_params", None)
        if params:
            out[s.module_type] = config_of_fused_params(params, base, f"{where}: {type(s).__name__}")
    return out


def sharder_comm_precision(sharders: Sequence[SharderSettings], where: str) -> CommPrecision | WirePrecision | None:
    """The one wire precision the sharders' ``qcomm_codecs_registry`` ask for (None: none asked)."""
    found: set[CommPrecision | WirePrecision] = set()
    for s in sharders:
        registry = s.qcomm_codecs_registry
        if registry is None:
            continue
        if not isinstance(registry, QCommsRegistry):
            raise UnsupportedFeatureError(
                f"{where}: {type(s).__name__}(qcomm_codecs_registry={type(registry).__name__}) is not supported; "
                f"build it with get_qcomm_codecs_registry(QCommsConfig(...)) ({SHARDERS_SECTION})"
            )
        found.add(registry.precision(f"{where}: {type(s).__name__}"))
    if len(found) > 1:
        raise UnsupportedFeatureError(
            f"{where}: sharders ask for different comm precisions {sorted(p.value for p in found)}; one per model"
        )
    return found.pop() if found else None


class DataParallelWrapper(abc.ABC):
    """TorchRec's hook for wrapping the dense part (for imports and annotations); ``DistributedModelParallel``
    refuses any instance: the dense part is always wrapped in ``DistributedDataParallel`` here."""

    @abc.abstractmethod
    def wrap(self, dmp: nn.Module, env: ShardingEnv, device: torch.device) -> None: ...


class WaitableDict(dict):  # type: ignore[type-arg]
    """A sharded collection's ``{feature: JaggedTensor}`` with TorchRec's ``wait()`` (the result is ready)."""

    def wait(self) -> WaitableDict:
        return self


def env_group(env: ShardingEnv | None, pg: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group of ``env`` (TorchRec's argument) or ``pg`` (ours); both: they must agree."""
    if env is None:
        return pg
    if not isinstance(env, ShardingEnv):
        raise TypeError(f"DistributedModelParallel: env must be a ShardingEnv, got {type(env).__name__}")
    if env.pg is None:
        if not dist.is_initialized() or dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise UnsupportedFeatureError(
                f"DistributedModelParallel: env=ShardingEnv(world_size={env.world_size}, rank={env.rank}) has no "
                "process group and none of that size is initialised; sharded training needs one "
                "(torch.distributed.init_process_group); for single-host serving use lightning_shardrec.inference "
                "(see docs/migrating.md, 'DistributedModelParallel')"
            )
        return pg
    if pg is not None and pg is not env.pg:
        raise ValueError("DistributedModelParallel: env and pg name different process groups; pass one")
    return env.pg


def _table_configs(module: nn.Module) -> list[tuple[str, type, FusedOptimConfig | None]]:
    """``(weight path, collection type, in-backward config)`` of every table weight of every collection."""
    out = []
    for path, coll in module.named_modules():
        if type(coll) not in _COLLECTIONS:
            continue
        for name, p in coll.named_parameters():
            where = f"table weight '{path}.{name}'" if path else f"table weight '{name}'"
            out.append((where, type(coll), in_backward_config(p, where)))
    return out


def in_backward_tables(module: nn.Module, sharders: Sequence[SharderSettings] = ()) -> set[str]:
    """Names of the tables ``apply_optimizer_in_backward`` (or a sharder's ``fused_params``) gave an optimizer:
    they must be fused, not ``data_parallel`` (plain weights, all-reduced by DDP, stepped by the dense optimizer).
    A table of a collection whose other tables have one but not itself is free to be ``data_parallel`` (TorchRec)."""
    with_params = {s.module_type for s in sharders if getattr(s, "fused_params", None)}
    out: set[str] = set()
    for coll in module.modules():
        if type(coll) not in _COLLECTIONS:
            continue
        method = "embedding_configs" if isinstance(coll, EmbeddingCollection) else "embedding_bag_configs"
        names = [c.name for c in getattr(coll, method)()]
        if type(coll) in with_params:
            out |= set(names)
            continue
        for name, p in coll.named_parameters():
            if getattr(p, "_optimizer_classes", None):
                out.add(name.split(".")[-2] if "." in name else names[0])
    return out


def fused_only(tables: set[str], constraints: Mapping[str, ParameterConstraints]) -> dict[str, ParameterConstraints]:
    """``constraints`` with ``tables`` limited to the fused kernel (so never ``data_parallel``)."""
    out = dict(constraints)
    for t in tables:
        c = out.get(t, ParameterConstraints())
        out[t] = dataclasses.replace(c, compute_kernels=[EmbeddingComputeKernel.FUSED])
    return out


def check_fused(
    tables: set[str], sharded: Mapping[str, nn.Module], undecided: set[str] | frozenset[str] = frozenset()
) -> None:
    """Refuse, by name, a table with an in-backward optimizer that a given plan made ``data_parallel``, and
    one of ``undecided`` (no optimizer of its own, while other tables have one) that the plan did not."""
    groups = [g for coll in sharded.values() for g in getattr(coll, "groups", [])]
    dense = sorted(t.config.name for g in groups if not g.fused for t in g.tables if t.config.name in tables)
    if dense:
        raise UnsupportedFeatureError(
            f"DistributedModelParallel: tables {dense} have a fused optimizer (apply_optimizer_in_backward or a "
            "sharder's fused_params) but the plan "
            "makes them data_parallel, where it would not run; plan them with ParameterConstraints("
            "compute_kernels=['fused']) or another sharding type (see docs/migrating.md, 'Optimizers')"
        )
    sharded_plain = sorted({t.config.name for g in groups if g.fused for t in g.tables if t.config.name in undecided})
    if sharded_plain:
        raise UnsupportedFeatureError(
            f"DistributedModelParallel: tables {sharded_plain} have no in-backward optimizer while other tables "
            "do; TorchRec would train them sharded with the dense optimizer, which has no kernel here: plan them "
            "data_parallel (ParameterConstraints(sharding_types=['data_parallel'])) or give them the others' "
            "optimizer with apply_optimizer_in_backward (see docs/migrating.md, 'Optimizers')"
        )


def undecided_tables(module: nn.Module, in_backward: set[str], explicit: object) -> set[str]:
    """Tables with no fused optimizer of their own while others have one (none when ``explicit`` is given)."""
    if explicit is not None or not in_backward:
        return set()
    every = set()
    for coll in module.modules():
        if type(coll) in _COLLECTIONS:
            method = "embedding_configs" if isinstance(coll, EmbeddingCollection) else "embedding_bag_configs"
            every |= {c.name for c in getattr(coll, method)()}
    return every - in_backward


def resolve_fused_config(
    module: nn.Module,
    explicit: FusedOptimConfig | str | None,
    sharders: Sequence[SharderSettings],
    where: str,
) -> FusedOptimConfig:
    """The one fused config every table of ``module`` trains with (see the module docstring)."""
    base = FusedOptimConfig(optimizer=EmbOptimType.parse(explicit)) if isinstance(explicit, str) else explicit
    by_type = sharder_optim(sharders, base or FusedOptimConfig(), where)
    chosen: dict[FusedOptimConfig, list[str]] = {}
    for table, kind, own in _table_configs(module):
        config = own or by_type.get(kind) or base
        if config is not None:  # else: data_parallel (the dense optimizer), or the one fused optimizer
            chosen.setdefault(config, []).append(table)
    if base is not None and chosen and set(chosen) != {base}:
        other = [f"{tables[0]}: {_describe(c)}" for c, tables in chosen.items() if c != base]
        raise UnsupportedFeatureError(
            f"{where}: embedding_optimizer={_describe(base)} conflicts with the optimizer set for the tables "
            f"({'; '.join(other)}); set it one way (see docs/migrating.md, 'Optimizers')"
        )
    if len(chosen) > 1:
        lines = "\n".join(f"  {_describe(c)}: {', '.join(t)}" for c, t in chosen.items())
        raise UnsupportedFeatureError(
            f"{where}: the tables would train with different fused optimizers; one per model is supported here:\n"
            f"{lines}\n(see docs/migrating.md, 'Optimizers')"
        )
    return next(iter(chosen)) if chosen else base or FusedOptimConfig()


def _describe(c: FusedOptimConfig) -> str:
    return f"{c.optimizer.value}(lr={c.lr}, eps={c.eps}, weight_decay={c.weight_decay})"


def resolve_comm_precision(
    explicit: str | WirePrecision | None,
    sharders: Sequence[SharderSettings],
    where: str = "DistributedModelParallel",
) -> CommPrecision | WirePrecision:
    """``comm_precision=`` (``"bf16"``, ``"fp16/bf16"``) else the sharders' qcomm config, else fp32; both must agree."""
    from_sharders = sharder_comm_precision(sharders, where)
    if explicit is None:
        return from_sharders or CommPrecision.FP32
    mine = parse_wire(explicit)
    if from_sharders is not None and from_sharders != mine:
        raise ValueError(
            f"{where}: comm_precision={mine.value} but the sharders' QCommsConfig asks for "
            f"{from_sharders.value}; pass one"
        )
    return mine


def materialize_meta(module: nn.Module, device: torch.device) -> None:
    """Allocate on ``device`` and reset every dense submodule whose own parameters are on ``meta`` (TorchRec's
    ``init_parameters``); a module without ``reset_parameters`` is refused, naming it."""
    for name, m in module.named_modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            continue
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"DistributedModelParallel(init_parameters=True): module '{name}' ({type(m).__name__}) has "
                "parameters on meta and no reset_parameters() to initialise them; build it on a real device"
            )
        m.to_empty(device=device, recurse=False)
        with torch.no_grad():
            reset()


def mark_in_backward(sharded: Mapping[str, nn.Module], optimizer: torch.optim.Optimizer) -> None:
    """Tag the fused tables' weights as TorchRec tags in-backward parameters (``in_backward_optimizer_filter``)."""
    for coll in sharded.values():
        for group in getattr(coll, "groups", []):
            if group.fused:
                for p in group.parameters():
                    _tag(p, optimizer)


def _tag(p: Tensor, optimizer: torch.optim.Optimizer) -> None:
    p._in_backward_optimizers = [optimizer]  # type: ignore[attr-defined]
