"""What both sharded collections (pooled and sequence) share: their tables, shards, and prefetch.

Prefetch (the pipelined input distribution, see :mod:`~lightning_shardrec.distributed.sharded.batch_dist`)::

    coll.enable_prefetch(new_group_like(coll.env))  # collective, once
    handle = coll.prefetch(next_kjt)   # every rank, same order; starts the async all-to-alls
    out = coll(kjt)                    # this batch (its own handle, if one was started)
    handle.progress()                  # optional: e.g. after this batch's forward
    out = coll(next_kjt)               # the same KJT object: waits on the handle, no new input dist
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.configs import BaseEmbeddingConfig, FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.sharded.batch_dist import (
    BatchTag,
    DistContext,
    EndOfData,
    PrefetchHandle,
    Split,
    start_end_of_data,
    start_input_dist,
)
from lightning_shardrec.distributed.sharding import DynamicMapping, EmbeddingSharding
from lightning_shardrec.errors import PrefetchedBatchEditedError, ShardingError
from lightning_shardrec.kernels import BatchedEmbeddingKernel, KernelBackend
from lightning_shardrec.modules import features as id_checks
from lightning_shardrec.modules.dynamic.mapper import DynamicIdMapper
from lightning_shardrec.modules.dynamic.stats import FIELDS, mapper_stats, stats_dict
from lightning_shardrec.modules.features import IdRanges, check_ids
from lightning_shardrec.planner import EmbeddingModuleShardingPlan, ShardMetadata
from lightning_shardrec.sparse import KeyedJaggedTensor


def static_features(tables: list[BaseEmbeddingConfig]) -> list[int] | None:
    """Positions of the features whose (per-feature) ``tables`` are static; None: all are."""
    static = [i for i, t in enumerate(tables) if t.dynamic is None]
    return None if len(static) == len(tables) else static


def check_static_ids(kjt: KeyedJaggedTensor, rows: list[int], names: list[str], static: list[int] | None) -> None:
    """:func:`check_ids` on the features of static tables (a dynamic table takes any int64 id)."""
    if static is None:
        check_ids(kjt, rows, names)
    elif static:
        check_ids(kjt.permute(static), [rows[i] for i in static], [names[i] for i in static])


class ShardingGroups(nn.ModuleList):
    """A collection's sharding groups in their fixed order: an ``nn.ModuleList`` typed by what it holds."""

    def __iter__(self) -> Iterator[EmbeddingSharding]:
        return super().__iter__()  # type: ignore[return-value]

    def __getitem__(self, index: int) -> EmbeddingSharding:  # type: ignore[override]
        return super().__getitem__(index)  # type: ignore[return-value]


class ShardedCollection(nn.Module):
    """Base of the sharded collections: ``groups`` of shardings over ``_configs`` tables."""

    #: state-dict prefix of the unsharded module's tables (``embedding_bags`` / ``embeddings``)
    weight_prefix: str
    groups: ShardingGroups
    _configs: list
    _feature_names: list[str]
    _split: Split
    env: ShardingEnv
    #: process group of the prefetched (async) input distribution; None: prefetch off
    _prefetch_env: ShardingEnv | None = None
    #: handles started and not yet consumed, oldest first (at most ``max_prefetched``)
    _prefetched: tuple[PrefetchHandle, ...] = ()
    max_prefetched = 2
    #: ints every rank adds to each (not prefetched) input distribution's header, checked on arrival
    batch_tag: BatchTag | None = None
    validate_ids: bool = True
    #: per feature (collection order): its table's rows and name; which features' tables are static
    _rows: list[int]
    _table_names: list[str]
    _static: list[int] | None
    _id_ranges: IdRanges | None = None

    def input_device(self) -> torch.device:
        """Where the input KJT goes before the input distribution."""
        raise NotImplementedError

    def host_checks_ids(self) -> bool:
        """Whether ``validate_ids`` checks ids on the host (CPU); else on the device (:meth:`id_check`)."""
        return self.validate_ids and not id_checks.checks_on_device(self.input_device())

    def id_check(self) -> IdRanges | None:
        """The ids' check on the device, read with the batch header (None: off, or done on the host)."""
        if not self.validate_ids or not id_checks.checks_on_device(self.input_device()):
            return None
        if self._id_ranges is None:
            self._id_ranges = IdRanges(self._rows, self._table_names, self._static)
        return self._id_ranges

    # --- prefetch -----------------------------------------------------------------------------
    def enable_prefetch(self, env: ShardingEnv) -> None:
        """Let :meth:`prefetch` run on ``env``: a process group of the same ranks that nothing else uses.

        Create it collectively (:func:`~lightning_shardrec.distributed.comm.groups.new_group_like`);
        several collections may share one.
        """
        own = self.env
        if (env.rank, env.world_size) != (own.rank, own.world_size):
            raise ValueError(
                f"{type(self).__name__}.enable_prefetch: the prefetch group has rank {env.rank} of "
                f"{env.world_size}, the collection's group rank {own.rank} of {own.world_size}; "
                "create it over the same ranks with new_group_like(collection.env)"
            )
        self._prefetch_env = env

    def disable_prefetch(self) -> None:
        """Drop whatever is prefetched and turn prefetch off (before its group is destroyed)."""
        self.drop_prefetched()
        self._prefetch_env = None

    def prefetch(self, features: KeyedJaggedTensor) -> PrefetchHandle:
        """Start ``features``' input distribution (async); ``forward(features)`` will wait on it.

        Collective on the prefetch group: every rank calls it, in the same order. Beyond
        ``max_prefetched`` handles in flight, the oldest is drained and dropped (its
        ``forward`` then redoes the input distribution).
        """
        if self._prefetch_env is None:
            raise RuntimeError(
                f"{type(self).__name__}.prefetch: prefetch is off; call enable_prefetch(env) first with a "
                "ShardingEnv of a dedicated process group (or train with ShardRecStrategy(pipeline=True))"
            )
        while len(self._prefetched) >= self.max_prefetched:
            self.drop_prefetched(self._prefetched[0])
        handle = start_input_dist(
            features,
            self._split,
            self._groups(),
            self._prefetch_env,
            self.input_device(),
            self.batch_tag,
            self.id_check(),
        )
        handle.versions = _versions(features)  # what the ids were sent from (an in-place edit shows here)
        self._prefetched = (*self._prefetched, handle)
        return handle

    def announce_end(self) -> EndOfData | None:
        """Where the other ranks :meth:`prefetch` their next batch and this rank has none (the same collective).

        ``wait()`` on the result raises :class:`~lightning_shardrec.errors.UnevenBatchesError`
        on every rank unless every rank's data ended; None without a prefetch group or tag.
        """
        if self._prefetch_env is None or self.batch_tag is None:
            return None
        return start_end_of_data(self._groups(), self._prefetch_env, self.input_device(), self.batch_tag)

    def drop_prefetched(self, handle: PrefetchHandle | None = None) -> None:
        """Drain and forget ``handle`` (default: every handle not consumed). Same calls on every rank."""
        for h in self._prefetched if handle is None else (handle,):
            h.drain()
        self._prefetched = () if handle is None else tuple(h for h in self._prefetched if h is not handle)

    def is_prefetched(self, handle: PrefetchHandle) -> bool:
        """Whether ``handle`` is still waiting for its ``forward``."""
        return any(h is handle for h in self._prefetched)

    def progress_prefetched(self) -> None:
        """Issue the id all-to-alls of every started handle whose header arrived, oldest first."""
        for h in self._prefetched:
            h.progress()

    def take_prefetched(self, features: KeyedJaggedTensor) -> DistContext | None:
        """The prefetched context when ``features`` is the object ``prefetch`` was given, else None."""
        if not self._prefetched:
            return None
        for i, h in enumerate(self._prefetched):
            if h.features is features:
                if _edited(h.versions, _versions(features)):
                    raise PrefetchedBatchEditedError(
                        f"{type(self).__name__} over features {self.feature_names()}: the batch's KeyedJaggedTensor "
                        "was changed in place (its values, lengths, offsets or weights) after the pipeline sent its "
                        "ids for this step, so the lookup would use the ids as they were. Build a new "
                        "KeyedJaggedTensor from the edited tensors (e.g. KeyedJaggedTensor(keys, "
                        "values=f(kjt.values()), lengths=kjt.lengths())): the step then redistributes it; "
                        "or train with ShardRecStrategy(pipeline=False)."
                    )
                for older in self._prefetched[:i]:  # keep every rank's issue order: oldest first
                    older.progress()
                self._prefetched = self._prefetched[:i] + self._prefetched[i + 1 :]
                return h.wait()
        return None

    def _take_tables(self, configs: list, plan: dict) -> None:  # type: ignore[type-arg]
        """Keep ``configs``; every table must have an entry in ``plan``."""
        missing = [t.name for t in configs if t.name not in plan]
        if missing:
            raise ShardingError(f"the sharding plan has no entry for tables {missing}")
        self._configs = configs
        self._module_sharding_plan = EmbeddingModuleShardingPlan({t.name: plan[t.name] for t in configs})

    def state_key(self, table: str) -> str:
        """``table``'s weight key in the unsharded module's state dict, relative to this module."""
        return f"{self.weight_prefix}.{table}.weight"

    def _release_full_weights(self) -> None:
        """Drop the references to the user's full ``[rows, dim]`` weights once every shard holds
        its copy, so the unsharded tables are freed with the module they came from."""
        for g in self._groups():
            g.tables = [replace(t, weight=None) for t in g.tables]

    @property
    def module_sharding_plan(self) -> EmbeddingModuleShardingPlan:
        """How this collection's tables are sharded (TorchRec's ``module_sharding_plan``)."""
        return self._module_sharding_plan

    def table_configs(self) -> list[BaseEmbeddingConfig]:
        return self._configs

    def feature_names(self) -> list[str]:
        return self._feature_names

    def dynamic_mappers(self) -> dict[str, DynamicIdMapper]:
        """This rank's id mapper of each dynamic table it holds buckets of (``bucket_lo/hi``, ``row_offset``)."""
        out: dict[str, DynamicIdMapper] = {}
        for g in self._groups():
            if isinstance(g, DynamicMapping):
                out.update((name, g.mapper(name)) for name in g.mappers)
        return out

    def kernels(self) -> list[BatchedEmbeddingKernel]:
        return [g.kernel for g in self._groups() if g.fused and g.kernel is not None]

    def rebuild_kernels(self, optim: FusedOptimConfig, backend: KernelBackend | str | None = None) -> None:
        """Every fused group's kernel rebuilt to train with ``optim`` from fresh state (rows kept)."""
        for g in self._groups():
            if g.fused:
                g.rebuild_kernel(optim, backend)

    def local_shards(self) -> dict[str, list[tuple[ShardMetadata, Tensor]]]:
        """``table -> [(shard metadata, [rows, cols] tensor)]`` held by this rank."""
        out: dict[str, list[tuple[ShardMetadata, Tensor]]] = {}
        for g in self._groups():
            for name, meta, w in g.local_shards():
                out.setdefault(name, []).append((meta, w))
        return out

    def local_states(self) -> dict[str, list[tuple[ShardMetadata, dict[str, Tensor]]]]:
        """``table -> [(shard metadata, fused optimizer state views)]`` held by this rank."""
        out: dict[str, list[tuple[ShardMetadata, dict[str, Tensor]]]] = {}
        for g in self._groups():
            if g.fused:
                for (name, meta, _), state in zip(g.local_shards(), g.local_states(), strict=True):
                    out.setdefault(name, []).append((meta, state))
        return out

    def dynamic_stats(self, new_window: bool = False) -> dict[str, dict[str, float]]:
        """Collective over ``env.pg``: per dynamic table, its figures (``modules.dynamic.stats.FIELDS``)
        summed over the ranks' mappers, tables in config order (every rank the same tensor), then the
        derived ones (``DERIVED``); ``new_window``: then every rank's mappers start a new window."""
        configs = [t for t in self._configs if t.dynamic is not None]
        names = [t.name for t in configs]
        if not names:
            return {}
        local = torch.zeros(len(names), len(FIELDS), dtype=torch.int64, device=self.input_device())
        for name, mapper in self.dynamic_mappers().items():
            local[names.index(name)] += mapper_stats(mapper).to(local.device)
        if self.env.world_size > 1:
            dist.all_reduce(local, group=self.env.pg)
        if new_window:
            for mapper in self.dynamic_mappers().values():
                mapper.new_window()
        return stats_dict(configs, local)

    def _groups(self) -> list[EmbeddingSharding]:
        return list(self.groups)

    # --- TorchRec's per-sharding pieces, by its private names, for programs that print them (issue 43) ---
    @property
    def _input_dists(self) -> list[object]:
        """Each sharding group's input distribution (``group.input_dist``), one per group as TorchRec lists them."""
        return [g.input_dist for g in self._groups()]

    @property
    def _lookups(self) -> list[nn.Module]:
        """Each sharding group's lookup kernel."""
        return [g.kernel for g in self._groups() if g.kernel is not None]

    @property
    def _output_dists(self) -> list[object]:
        """Each sharding group's output distribution (``group.output_dist``)."""
        return [g.output_dist for g in self._groups()]


def _versions(kjt: KeyedJaggedTensor) -> tuple[tuple[int, int] | None, ...]:
    """Identity and in-place version of each tensor ``kjt`` holds (values, weights, lengths, offsets; None: not
    held)."""
    held = (kjt.values(), kjt.weights_or_none(), kjt.lengths_or_none(), kjt.offsets_or_none())
    return tuple(None if t is None else (id(t), compat.inplace_version(t)) for t in held)


def _edited(sent: tuple[tuple[int, int] | None, ...], now: tuple[tuple[int, int] | None, ...]) -> bool:
    """Whether a tensor held when the ids were sent was replaced or changed in place since. One held only now
    (lengths or offsets the KJT derived later, on a ``kjt.offsets()`` call) is not an edit."""
    return any(before is not None and before != after for before, after in zip(sent, now, strict=True))
