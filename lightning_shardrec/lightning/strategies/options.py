"""``ShardRecOptions``: the options that are ``ShardRecStrategy``'s own (not ``DDPStrategy``'s).

One frozen dataclass: every option's meaning and default in one place, checked at
construction (each bad value is refused with its name, the value and what is valid), and
what the options mean for the fused optimizer, the planner and the kernels.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import CommPrecision
from lightning_shardrec.distributed.comm.qcomm import WirePrecision, parse_wire
from lightning_shardrec.distributed.comm.transport import parse_transport
from lightning_shardrec.distributed.dmp.dmp_settings import (
    fused_only,
    in_backward_tables,
    resolve_comm_precision,
    resolve_fused_config,
)
from lightning_shardrec.distributed.dmp.model_parallel import pooling_of
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder, check_sharders
from lightning_shardrec.distributed.sharding import KernelSetup
from lightning_shardrec.kernels import KernelBackend, parse_backend
from lightning_shardrec.lightning.parameters.optimizers import Holder, derive_fused_config
from lightning_shardrec.lightning.training.uneven import check_mode as check_uneven_mode
from lightning_shardrec.modules.plain_embeddings import check_embedding_options
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    Topology,
)
from lightning_shardrec.planner.machine.memory import DEFAULT_RESERVE, check_reserve


@dataclass(frozen=True, kw_only=True)
class ShardRecOptions:
    """What :class:`~lightning_shardrec.lightning.ShardRecStrategy` does beyond ``DDPStrategy``.

    ``__post_init__`` checks every option and stores it parsed: ``embedding_optimizer`` may be
    a name, ``kernel`` and ``comm_precision`` their names (``"fp16/bf16"``), ``constraints``
    and ``sharders`` None, as the strategy takes them.

    Attributes:
        embedding_optimizer: fused optimizer name or config; default: derived from the
            optimizer ``configure_optimizers`` puts the tables in.
        embedding_lr: the tables' lr, when it should differ from the derived one.
        constraints: per table name, what the planner may do with it.
        plan: a whole or partial plan (table name -> ``ParameterSharding``) to pin.
        kernel: ``"auto"`` (each table group times the backends that can run it on this
            machine and keeps the faster; cached, see :mod:`lightning_shardrec.kernels.autotune`),
            ``"fbgemm"`` or ``"torch"``.
        comm_precision: ``"fp32"`` (exact), ``"bf16"``, ``"fp16"`` or forward/backward (``"fp16/bf16"``,
            as TorchRec's ``QCommsConfig(forward_precision, backward_precision)``): the precision of the pooled
            embeddings' all-to-alls / reduce-scatters and their gradients (half the bytes). The default
            fp32 yields to the sharders' ``QCommsConfig``; any other value must agree with it.
        comm_transport: None (default: ``$LIGHTNING_SHARDREC_TRANSPORT``, else ``"pg"``: the process
            group's collectives, as under NCCL), ``"auto"`` (the embeddings' all-to-alls go through
            shared memory when every rank is on this host under gloo, see
            :mod:`lightning_shardrec.distributed.transport.shm`; on several hosts through shared memory
            inside each and the process group between them,
            :mod:`~lightning_shardrec.distributed.transport.per_host`; else through the process group;
            printed at fit start per host), ``"shm"`` (required) or ``"pg"``. Results are identical
            either way (2 ranks: bit for bit).
        pipeline: overlap the next batch's input distribution (id all-to-alls, host-to-device copy)
            with this batch's forward/backward (see :mod:`lightning_shardrec.lightning.training.pipeline`);
            results are identical to ``pipeline=False``. None (default): on where ranks exchange ids (a fit on
            2+ ranks; it measured 1.05-1.1x faster), said at fit start; ``False`` turns it off.
        planner_batch_size: per-rank batch size the planner's cost model assumes.
        planner_reserve: fraction of each device's memory the planner keeps free for the dense
            model, activations, communication buffers, the CUDA context and allocator slack
            (default 0.15); plans whose tables need more are refused with the arithmetic.
        checkpoint_format: ``"sharded"`` (a DCP directory: each rank writes its shards;
            loads on any world size) or ``"full"`` (one file with gathered tables, for
            tables that fit in host memory; loads into the plain model).
        check_finite: raise ``NonFiniteError`` naming the table when the loss, a gradient
            reaching a fused table, or an updated row is NaN/inf (one device sync per check).
        heartbeat_timeout: seconds without a heartbeat after which a rank counts as dead (or
            hung) and every rank exits naming it; ``None`` turns the watchdog off. Failed
            collectives are explained (which rank went away) either way.
        embedding_modules: which plain ``nn.Embedding`` / ``nn.EmbeddingBag`` submodules to shard
            in place (same call, same results, checkpoints under their own ``<path>.weight``):
            ``True`` all, ``False`` none (they stay data-parallel), or a list of module paths.
        embedding_min_rows: with ``embedding_modules=True``, modules with fewer rows stay data-parallel.
        strict_optimizer: refuse to train fused tables with an update rule that differs from
            what the user's optimizer does in one process (lazy Adam, row-sparse weight decay;
            the rule each table gets is printed at every fit start).
        log_dynamic_stats: add a :class:`~lightning_shardrec.lightning.reports.dynamic_monitor.DynamicTableMonitor`
            (each dynamic table's occupancy, admissions, evictions, misses, ... summed over ranks, logged
            every ``log_every_n_steps``) when the model has dynamic tables and the Trainer has none.
        uneven_batches: ``"pad"`` (default): a rank whose training data ends before the others' trains
            on with empty batches (zero rows, no update from it) until every rank's data has ended, so
            every batch of every rank trains once and the epoch ends together
            (:mod:`lightning_shardrec.lightning.training.uneven`: one small all-reduce per batch); ``"error"``:
            the strict mode, every rank stops with ``UnevenBatchesError`` at the last batch they share.
        full_tables_after_fit: at the end of every fit, while every rank is still there, gather the full
            tables to rank 0, so that ``model.state_dict()`` and ``model(batch)`` work on rank 0 alone after
            fit (:mod:`lightning_shardrec.lightning.checkpoints.after_fit`): ``None`` (the default) when they take at
            most 64 MiB and fit in a quarter of its available host memory (larger tables stay sharded:
            every rank holds its share); ``True`` whenever they fit in that quarter; ``False`` never. Cost:
            one gather per fit, and rank 0 holds every table until the next fit.
        sharders: TorchRec's ``EmbeddingBagCollectionSharder`` / ``EmbeddingCollectionSharder``:
            their ``fused_params`` set the tables' fused optimizer and their qcomm config the
            ``comm_precision`` (as does ``apply_optimizer_in_backward`` on the tables); see
            docs/migrating.md, 'Sharders'.
    """

    embedding_optimizer: FusedOptimConfig | None = None
    embedding_lr: float | None = None
    constraints: dict[str, ParameterConstraints] = field(default_factory=dict)
    plan: ShardingPlan | Mapping[str, ParameterSharding] | None = None
    kernel: KernelBackend = KernelBackend.AUTO
    comm_precision: CommPrecision | WirePrecision = CommPrecision.FP32
    comm_transport: str | None = None
    pipeline: bool | None = None
    planner_batch_size: int = 512
    planner_reserve: float = DEFAULT_RESERVE
    checkpoint_format: str = "sharded"
    check_finite: bool = False
    heartbeat_timeout: float | None = 60.0
    embedding_modules: bool | list[str] = True
    embedding_min_rows: int = 0
    strict_optimizer: bool = False
    log_dynamic_stats: bool = True
    sharders: list[ModuleSharder[Any]] = field(default_factory=list)
    uneven_batches: str = "pad"
    full_tables_after_fit: bool | None = None

    def __post_init__(self) -> None:
        heartbeat = self.heartbeat_timeout
        if heartbeat is not None and heartbeat <= 1.0:
            raise ValueError(f"heartbeat_timeout must be > 1 second (or None to disable), got {heartbeat}")
        if isinstance(self.embedding_optimizer, str):  # validates the name
            named = FusedOptimConfig(optimizer=self.embedding_optimizer)  # type: ignore[arg-type]
            self._set("embedding_optimizer", named)
        lr = self.embedding_lr
        if lr is not None and not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"ShardRecStrategy: embedding_lr must be a number >= 0, got {lr!r}")
        if not (isinstance(self.planner_batch_size, int) and self.planner_batch_size > 0):
            raise ValueError(
                f"ShardRecStrategy: planner_batch_size must be an int > 0, got {self.planner_batch_size!r}"
            )
        self._set("sharders", check_sharders(self.sharders, "ShardRecStrategy"))
        # "fp16/bf16": forward / backward; the default fp32 yields to a sharder's QCommsConfig
        explicit = None if parse_wire(self.comm_precision) is CommPrecision.FP32 else self.comm_precision
        self._set("comm_precision", resolve_comm_precision(explicit, self.sharders, "ShardRecStrategy"))
        self._set("kernel", parse_backend(self.kernel))
        self._set("comm_transport", parse_transport(self.comm_transport))
        self._set("planner_reserve", check_reserve(self.planner_reserve, "ShardRecStrategy: planner_reserve"))
        if self.checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format must be 'sharded' or 'full', got {self.checkpoint_format!r}")
        which = check_embedding_options(self.embedding_modules, self.embedding_min_rows, "ShardRecStrategy")
        self._set("embedding_modules", which)
        self._set("constraints", dict(self.constraints or {}))
        check_uneven_mode(self.uneven_batches)
        if self.full_tables_after_fit not in (None, True, False):
            raise ValueError(
                f"ShardRecStrategy: full_tables_after_fit must be None (default: tables of at most 64 MiB), True or "
                f"False, got {self.full_tables_after_fit!r}"
            )

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ stores the parsed form

    # --- what the options mean --------------------------------------------------------------------
    def sets_fused_rule(self) -> bool:
        """Whether the user chose the tables' rule (``embedding_optimizer`` or ``embedding_lr``)."""
        return self.embedding_optimizer is not None or self.embedding_lr is not None

    def torchrec_config(self, module: torch.nn.Module) -> FusedOptimConfig | None:
        """The fused config TorchRec's ways set (``apply_optimizer_in_backward``, sharders' ``fused_params``);
        None when neither is used. Conflicts with ``embedding_optimizer`` are refused by name."""
        if not in_backward_tables(module, self.sharders):
            return None
        return resolve_fused_config(module, self.embedding_optimizer, self.sharders, "ShardRecStrategy")

    def fused_config(self, holder: Holder | None, migrated: FusedOptimConfig | None) -> FusedOptimConfig:
        """The tables' fused rule: TorchRec's (``migrated``), else ``embedding_optimizer``, else derived
        from the holder's param group (its lr as configured), else the default; ``embedding_lr`` replaces
        its lr. That lr is the tables' base lr, which the fused optimizer scales as the holder's group
        is scheduled (``FusedOptimizer.link_lr``)."""
        if migrated is not None:
            config = migrated
        elif self.embedding_optimizer is not None:
            config = self.embedding_optimizer
        elif holder is not None:  # the group's lr as configured: a scheduler may have scaled it already
            opt, group = holder
            config = derive_fused_config(opt, {**group, "lr": group.get("initial_lr", group["lr"])})
        else:
            config = FusedOptimConfig()
        if self.embedding_lr is not None:
            config = FusedOptimConfig(**{**config.__dict__, "lr": self.embedding_lr})
        return config

    def planner(self, topology: Topology, fused_tables: set[str], config: FusedOptimConfig) -> EmbeddingShardingPlanner:
        """The planner for ``topology``: ``fused_tables`` (TorchRec's optimizer settings) planned fused."""
        return EmbeddingShardingPlanner(
            topology,
            batch_size=self.planner_batch_size,
            constraints=fused_only(fused_tables, self.constraints),
            optimizer=config.optimizer,
            reserve=self.planner_reserve,
        )

    def kernel_setup(self, config: FusedOptimConfig, device: torch.device, deferred: bool) -> KernelSetup:
        """How each rank builds its kernels (``deferred`` updates: the torch kernels)."""
        return KernelSetup(
            optim=config,
            backend=KernelBackend.TORCH if deferred else self.kernel,
            device=device,
            batch_size=self.planner_batch_size,
            pooling=pooling_of(self.constraints),
            comm_precision=self.comm_precision,
        )


def with_strategy_args(doc: str | None) -> str:
    """A strategy's class docstring with :data:`STRATEGY_ARGS` appended (at run time: the CLI's help and
    ``help()`` show each option; the API reference, read statically, points to :class:`ShardRecOptions`)."""
    return f"{(doc or '').rstrip()}\n\n{textwrap.indent(STRATEGY_ARGS, '    ')}"


#: The ``Args`` section of both strategies' docstrings (Trainer and Fabric: the same options; the CLI
#: shows each line as the option's help).
STRATEGY_ARGS = """Args:
    embedding_optimizer: fused optimizer name or config; default: derived from the user's optimizer.
    embedding_lr: the tables' lr, when it should differ from the derived one.
    constraints: per table name, what the planner may do with it.
    plan: a whole or partial plan (table name -> ``ParameterSharding``) to pin.
    kernel: ``"auto"`` (the faster backend on this machine, timed per table group), ``"fbgemm"`` or ``"torch"``.
    comm_precision: the pooled embeddings' collectives and their gradients: ``"fp32"`` (exact), ``"bf16"``,
        ``"fp16"`` or forward/backward (``"fp16/bf16"``, as TorchRec's ``QCommsConfig``).
    comm_transport: None (``$LIGHTNING_SHARDREC_TRANSPORT``, else ``"pg"``), ``"auto"`` (shared memory
        inside a host under gloo), ``"shm"`` (required) or ``"pg"`` (the process group); identical results.
    pipeline: overlap the next batch's input distribution with this batch's step; identical results.
    process_group_backend: ``DDPStrategy``'s (e.g. ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``).
    planner_batch_size: per-rank batch size the planner's cost model assumes.
    planner_reserve: fraction of each device's memory the planner keeps free (default 0.15).
    checkpoint_format: ``"sharded"`` (DCP, each rank its shards, any world size) or ``"full"`` (one file).
    check_finite: raise ``NonFiniteError`` naming the table on a NaN/inf loss, table gradient or row.
    heartbeat_timeout: seconds without a heartbeat before a rank counts as dead; ``None``: no watchdog.
    timeout: the process groups' collective timeout (default 10 minutes: long enough
        for a rank writing a large checkpoint while the others wait at the barrier).
    embedding_modules: plain ``nn.Embedding`` / ``nn.EmbeddingBag`` submodules to shard in place:
        ``True`` all, ``False`` none (they stay data-parallel), or a list of module paths.
    embedding_min_rows: with ``embedding_modules=True``, modules with fewer rows stay data-parallel.
    strict_optimizer: refuse a fused update rule that differs from the user's optimizer in one process.
    find_unused_parameters: passed to the dense layers' ``DistributedDataParallel`` (default ``False``).
    static_graph: passed to the dense layers' ``DistributedDataParallel`` (default ``False``).
    gradient_as_bucket_view: passed to the dense layers' ``DistributedDataParallel`` (default ``False``).
    log_dynamic_stats: log each dynamic table's figures when the Trainer has no ``DynamicTableMonitor``.
    start_method: how Lightning launches the ranks (``DDPStrategy``'s meaning): ``"popen"``
        (scripts, the CLI), ``"spawn"``, ``"fork"`` or ``"forkserver"`` (notebooks).
    sharders: TorchRec's sharders: their ``fused_params`` set the fused optimizer, their qcomm config
        the ``comm_precision`` (docs/migrating.md, 'Sharders').
    uneven_batches: ``"pad"`` (a rank whose training data ends early trains on with empty batches until
        every rank's has ended) or ``"error"`` (strict: ``UnevenBatchesError``).
    full_tables_after_fit: gather the full tables to rank 0 at the end of each fit, so
        ``model.state_dict()`` and ``model(batch)`` work on rank 0 alone after fit: ``None`` (default)
        when they take at most 64 MiB, ``True`` whenever they fit in its memory, ``False`` never.

Each of the strategy's own options is explained in full, and checked, by
:class:`~lightning_shardrec.lightning.strategies.options.ShardRecOptions` (``self.options``).
Only these options exist (no ``**kwargs`` passed through to ``DistributedDataParallel``),
so a config's ``class_path: lightning_shardrec.ShardRecStrategy`` lists exactly them.
"""
