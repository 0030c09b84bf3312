"""``ShardRecStrategy`` (``strategy="shardrec"``): shard embedding tables, DDP the rest.

A thin layer over Lightning's ``DDPStrategy`` (its launchers, cluster environments,
process-group setup, ``barrier``/``reduce``/``all_gather``). What it adds, in
``setup``: plan and shard the module's embedding collections, move the tables out
of the user's optimizer into the fused in-backward optimizer (derived from the
user's, lr linked so schedulers move both), and wrap only the dense rest in DDP.
Checkpoints: :mod:`lightning_shardrec.lightning.checkpointing`; rank failures:
:mod:`lightning_shardrec.lightning.rank_failures` (on :mod:`lightning_shardrec.distributed.health`);
NaN checks: :mod:`lightning_shardrec.kernels.finite`.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_shardrec.checkpoint import param_layout, table_parameter_keys
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.distributed.collection import ShardedCollection
from lightning_shardrec.distributed.comm import CommPrecision, ShardingEnv
from lightning_shardrec.distributed.dmp_settings import (
    check_fused,
    fused_only,
    in_backward_tables,
    resolve_comm_precision,
    resolve_fused_config,
)
from lightning_shardrec.distributed.groups import live_group, new_group_like
from lightning_shardrec.distributed.model_parallel import find_collections, kernel_labels, pooling_of, shard_modules
from lightning_shardrec.distributed.qcomm import parse_wire
from lightning_shardrec.distributed.sharders import ModuleSharder, check_sharders
from lightning_shardrec.distributed.sharding import KernelSetup
from lightning_shardrec.distributed.transport.allreduce_hook import use_shm_allreduce
from lightning_shardrec.distributed.transport.connect import attach, parse_transport
from lightning_shardrec.distributed.transport.per_host import HostTransport, transport_report
from lightning_shardrec.distributed.transport.shm import ShmTransport
from lightning_shardrec.kernels import KernelBackend, parse_backend
from lightning_shardrec.kernels.finite import FiniteGuard, check_loss
from lightning_shardrec.lightning import guards
from lightning_shardrec.lightning.cluster import ranks_per_host
from lightning_shardrec.lightning.deferred import DeferredGlue, deferral_line, deferral_reason
from lightning_shardrec.lightning.dynamic_monitor import add_dynamic_monitor
from lightning_shardrec.lightning.optimizers import (
    derive_fused_config,
    find_group,
    group_at,
    group_slot,
    remove_params,
    rule_report,
)
from lightning_shardrec.lightning.pipeline import TrainPipeline
from lightning_shardrec.lightning.precision import ScalerGlue, convert_dense
from lightning_shardrec.lightning.rank_failures import RankFailureHandling
from lightning_shardrec.lightning.sigterm import LaggedSigterm, SigtermDeadline
from lightning_shardrec.lightning.table_memory import has_meta_tables, tables_hidden
from lightning_shardrec.lightning.teardown import destroy_groups
from lightning_shardrec.modules.plain_embeddings import check_embedding_options, swap_embedding_modules
from lightning_shardrec.modules.table_init import tables_on_meta
from lightning_shardrec.optim import FusedOptimizer, ScaledTableUpdates
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    Topology,
)
from lightning_shardrec.planner.memory import DEFAULT_RESERVE, check_reserve, peak_line


class ShardRecStrategy(RankFailureHandling):
    """Embedding tables sharded and trained in backward; dense layers data-parallel.

    Args:
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
            embeddings' all-to-alls / reduce-scatters and their gradients (half the bytes).
        comm_transport: None (default: ``$LIGHTNING_SHARDREC_TRANSPORT``, else ``"pg"``: the process
            group's collectives, as under NCCL), ``"auto"`` (the embeddings' all-to-alls go through
            shared memory when every rank is on this host under gloo, see
            :mod:`lightning_shardrec.distributed.transport.shm`; on several hosts through shared memory
            inside each and the process group between them,
            :mod:`~lightning_shardrec.distributed.transport.per_host`; else through the process group;
            printed at fit start per host), ``"shm"`` (required) or ``"pg"``. Results are identical
            either way (2 ranks: bit for bit).
        pipeline: overlap the next batch's input distribution (id all-to-alls, host-to-device copy)
            with this batch's forward/backward (see :mod:`lightning_shardrec.lightning.pipeline`);
            results are identical to ``pipeline=False``.
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
        timeout: the process groups' collective timeout (default 10 minutes: long enough
            for a rank writing a large checkpoint while the others wait at the barrier).
        embedding_modules: which plain ``nn.Embedding`` / ``nn.EmbeddingBag`` submodules to shard
            in place (same call, same results, checkpoints under their own ``<path>.weight``):
            ``True`` all, ``False`` none (they stay data-parallel), or a list of module paths.
        embedding_min_rows: with ``embedding_modules=True``, modules with fewer rows stay data-parallel.
        strict_optimizer: refuse to train fused tables with an update rule that differs from
            what the user's optimizer does in one process (lazy Adam, row-sparse weight decay;
            the rule each table gets is printed at every fit start).
        find_unused_parameters: passed to the dense layers' ``DistributedDataParallel`` (default ``False``).
        static_graph: passed to the dense layers' ``DistributedDataParallel`` (default ``False``).
        gradient_as_bucket_view: passed to the dense layers' ``DistributedDataParallel`` (default ``False``).
        log_dynamic_stats: add a :class:`~lightning_shardrec.lightning.dynamic_monitor.DynamicTableMonitor`
            (each dynamic table's occupancy, admissions, evictions, misses, ... summed over ranks, logged
            every ``log_every_n_steps``) when the model has dynamic tables and the Trainer has none.
        start_method: how Lightning launches the ranks (``DDPStrategy``'s meaning): ``"popen"``
            (scripts, the CLI), ``"spawn"``, ``"fork"`` or ``"forkserver"`` (notebooks).
        sharders: TorchRec's ``EmbeddingBagCollectionSharder`` / ``EmbeddingCollectionSharder``:
            their ``fused_params`` set the tables' fused optimizer and their qcomm config the
            ``comm_precision`` (as does ``apply_optimizer_in_backward`` on the tables); see
            docs/migrating.md, 'Sharders'.

    Only these options exist (no ``**kwargs`` passed through to ``DistributedDataParallel``),
    so a config's ``class_path: lightning_shardrec.ShardRecStrategy`` lists exactly them.
    """

    strategy_name = "shardrec"

    def __init__(
        self,
        embedding_optimizer: str | FusedOptimConfig | None = None,
        embedding_lr: float | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        plan: ShardingPlan | Mapping[str, ParameterSharding] | None = None,
        kernel: str = "auto",
        comm_precision: str = "fp32",
        comm_transport: str | None = None,
        pipeline: bool = False,
        process_group_backend: str | None = None,
        planner_batch_size: int = 512,
        planner_reserve: float = DEFAULT_RESERVE,
        checkpoint_format: str = "sharded",
        check_finite: bool = False,
        heartbeat_timeout: float | None = 60.0,
        timeout: timedelta | None = timedelta(minutes=10),
        embedding_modules: bool | Sequence[str] = True,
        embedding_min_rows: int = 0,
        strict_optimizer: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        log_dynamic_stats: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        sharders: Sequence[ModuleSharder[Any]] | None = None,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        if heartbeat_timeout is not None and heartbeat_timeout <= 1.0:
            raise ValueError(f"heartbeat_timeout must be > 1 second (or None to disable), got {heartbeat_timeout}")
        self._heartbeat_timeout = heartbeat_timeout
        self._check_finite = check_finite
        self._finite: FiniteGuard | None = None
        self._pipeline_on = pipeline
        self.pipeline: TrainPipeline | None = None
        self._sigterm: LaggedSigterm | None = None  # Lightning's per-batch SIGTERM broadcast, made async
        self._deadline: SigtermDeadline | None = None  # SIGTERM ends a rank within seconds (lightning/sigterm.py)
        self._own_groups: list[dist.ProcessGroup] = []  # destroyed in teardown (lightning/teardown.py)
        self._dense_transport: ShmTransport | HostTransport | None = None  # the DDP hook's (closed in teardown)
        if isinstance(embedding_optimizer, str):
            embedding_optimizer = FusedOptimConfig(optimizer=embedding_optimizer)  # validates the name
        if embedding_lr is not None and not (isinstance(embedding_lr, (int, float)) and embedding_lr >= 0):
            raise ValueError(f"ShardRecStrategy: embedding_lr must be a number >= 0, got {embedding_lr!r}")
        if not (isinstance(planner_batch_size, int) and planner_batch_size > 0):
            raise ValueError(f"ShardRecStrategy: planner_batch_size must be an int > 0, got {planner_batch_size!r}")
        self._embedding_optimizer = embedding_optimizer
        self._sharders = check_sharders(sharders, "ShardRecStrategy")
        # "fp16/bf16": forward / backward; the default fp32 yields to a sharder's QCommsConfig
        explicit = None if parse_wire(comm_precision) is CommPrecision.FP32 else comm_precision
        wire = resolve_comm_precision(explicit, self._sharders, "ShardRecStrategy")
        self._strict_optimizer = strict_optimizer
        self._log_dynamic_stats = log_dynamic_stats
        self._holder_slot: tuple[int, int] | None = None  # the param group the tables train as, across fits
        self._migrated: FusedOptimConfig | None = None  # set by apply_optimizer_in_backward / sharders
        self.guard: guards.ShardedGuard | None = None
        self._embedding_lr = embedding_lr
        self._constraints = dict(constraints or {})
        self._fixed_plan = plan
        self._kernel = parse_backend(kernel)
        self._comm_precision = wire
        self._comm_transport = parse_transport(comm_transport)
        self._planner_batch_size = planner_batch_size
        self._planner_reserve = check_reserve(planner_reserve, "ShardRecStrategy: planner_reserve")
        if checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format must be 'sharded' or 'full', got {checkpoint_format!r}")
        self._checkpoint_format = checkpoint_format
        self._embedding_modules = check_embedding_options(embedding_modules, embedding_min_rows, "ShardRecStrategy")
        self._embedding_min_rows = embedding_min_rows
        self._loaded_in_place = False
        self.sharded: dict[str, ShardedCollection] = {}
        self.plan: ShardingPlan | None = None
        self.topology: Topology | None = None  # what the planner assumed (hosts from num_nodes x devices)
        self.fused_optimizer: FusedOptimizer | None = None
        self._scaler_glue: ScalerGlue | None = None  # "16-mixed": table updates follow the GradScaler
        self._deferral: str | None = None  # why this fit's table updates wait for the optimizer step
        self._deferred_glue: DeferredGlue | None = None

    # --- model construction -------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()`` and ``configure_model``: dense layers on the device as usual, the
        collections' tables on ``meta`` (each rank builds only its shards, from the tables' seeds, in setup)."""
        with super().tensor_init_context(empty_init), tables_on_meta():
            yield

    # --- setup --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        """Each phase in its own method: find the tables, (fit) pick the tables' param group, shard (or,
        for a later fit, rebuild the fused state), (fit) hand the tables to the fused optimizer, place
        the model, (fit) wrap the dense rest in DDP, precision, and (fit) the per-step helpers."""
        module = self.lightning_module
        assert module is not None and self.accelerator is not None
        collections = self._find_tables(module)
        if not collections and not self.sharded:
            rank_zero_info("ShardRecStrategy: the LightningModule has no embedding collection; training as plain DDP")
            return super().setup(trainer)
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._deferral = deferral_reason(trainer, module) if fitting else None  # accumulation, norm clipping
        table_params = [p for c in collections.values() for p in c.parameters()]
        table_params += [p for s in self.sharded.values() for p in _fused_params(s)]
        holder = self._table_holder(trainer, collections, table_params) if fitting else None
        if collections:
            self._shard_collections(trainer, module, holder)
        elif fitting:  # sharded by validate/test/predict or an earlier fit: fresh fused state, this fit's rule
            self._renew_fused_state(holder)
        if fitting:
            self._hand_tables_to_fused(trainer, module, collections, table_params, holder)
        kernels = self._place_model(holder)
        if fitting:
            self.model = self._wrap_dense(self.model)
            self._register_ddp_hooks()
        self.setup_precision_plugin()
        if fitting:
            self._fit_helpers(kernels, holder)

    def _find_tables(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The collections still to shard (plain embedding modules swapped in place first); adopts the
        collections an earlier Trainer's strategy sharded when there are none."""
        swap_embedding_modules(module, self._embedding_modules, self._embedding_min_rows)
        collections = find_collections(module)
        if not collections and not self.sharded:
            self._adopt(module)  # sharded by an earlier Trainer's strategy
        return collections

    def _table_holder(
        self, trainer: Any, collections: Mapping[str, torch.nn.Module], table_params: list[torch.nn.Parameter]
    ) -> tuple[torch.optim.Optimizer, dict[str, Any]] | None:
        """Fit: the user's optimizers, built over shapes of the tables (no optimizer state allocated for
        them), and the param group the tables train as (kept across fits)."""
        fused = [g for s in self.sharded.values() for g in s.groups if g.fused]
        with tables_hidden([*collections.values(), *fused], lambda: self.optimizers):
            self.setup_optimizers(trainer)
        holder = find_group(self.optimizers, table_params)
        holder = holder or group_at(self.optimizers, self._holder_slot)  # a later fit: tables not in it
        self._holder_slot = group_slot(self.optimizers, holder)
        return holder

    def _shard_collections(
        self, trainer: Any, module: torch.nn.Module, holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None
    ) -> None:
        """Plan and shard (collective); each collection gets the anchor its param group is found by."""
        self._migrated = self._torchrec_config(module)
        self._shard(module, self._fused_config(holder))
        for coll in self.sharded.values():  # where a later configure_optimizers puts it = where the tables train
            coll.register_parameter(_ANCHOR, torch.nn.Parameter(torch.empty(0, device=self.root_device)))
        _save_plan(self.plan, getattr(trainer.checkpoint_callback, "dirpath", None))

    def _renew_fused_state(self, holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None) -> None:
        """A fit on collections sharded before: this fit's rule, a fresh fused state."""
        self._config = self._fused_config(holder)
        self.fused_optimizer = None
        for coll in self.sharded.values():
            coll.rebuild_kernels(self._config)

    def _hand_tables_to_fused(
        self,
        trainer: Any,
        module: LightningModule,
        collections: Mapping[str, torch.nn.Module],
        table_params: list[torch.nn.Parameter],
        holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None,
    ) -> None:
        """Fit: the fused tables leave the user's optimizers (data-parallel tables join the holder's group);
        the rule report, clipping guards and the dynamic tables' monitor."""
        # as configure_optimizers built them (tables as keys: no full weight kept): a plain run's state resumes
        keys = {**dict.fromkeys(map(id, table_params), ""), **table_parameter_keys(collections, self.sharded)}
        self._groups_before = param_layout(self.optimizers, keys)
        remove_params(self.optimizers, table_params)
        dense_tables = [p for s in self.sharded.values() for g in s.groups if not g.fused for p in g.parameters()]
        held = {id(p) for o in self.optimizers for g in o.param_groups for p in g["params"]}
        dense_tables = [p for p in dense_tables if id(p) not in held]
        if dense_tables and holder is not None:
            holder[1]["params"].extend(dense_tables)  # data-parallel tables train like dense layers
        self._fit_guards(trainer, holder)
        if self._log_dynamic_stats:
            add_dynamic_monitor(trainer, module)  # every rank: gathering the figures is collective

    def _place_model(self, holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None) -> list[Any]:
        """Dense precision, the model on its device, the fused optimizer (lr linked to the holder's group),
        the origin a later Trainer adopts, the collective-call guard; the kernels of every table group."""
        convert_dense(self.precision_plugin, self.model, self.sharded)  # tables keep their config's dtype
        self.model_to_device()
        kernels = [k for s in self.sharded.values() for k in s.kernels()]
        if self.fused_optimizer is None:
            self.fused_optimizer = FusedOptimizer(kernels, self._config)
        if holder is not None:
            self.fused_optimizer.link_lr(holder[1])
        for coll in self.sharded.values():  # for a later Trainer's strategy (see _adopt)
            coll.shardrec_origin = (self.plan, self._holder_slot, self._config)  # type: ignore[assignment]
        if self.guard is None and self.sharded:
            self.guard = guards.ShardedGuard(self.sharded, lambda: getattr(self.lightning_module, "_trainer", None))
        return kernels

    def _fit_helpers(self, kernels: list[Any], holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None) -> None:
        """Fit, after precision: optimizers on the device, the GradScaler glue, the finite guard, the pipeline."""
        _optimizers_to_device(self.optimizers, self.root_device)
        scaler = ScalerGlue.wanted(self.precision_plugin)
        group = next(iter(self.sharded.values())).env.pg
        deferred = self._deferral is not None and any(g.fused for s in self.sharded.values() for g in s._groups())
        # updates at the optimizer step (lightning/deferred.py), the scaler's decision included
        self._deferred_glue = DeferredGlue.attach(self, kernels, holder, group, scaler) if deferred else None
        self._scaler_glue = (
            None
            if scaler is None or deferred
            else ScalerGlue(scaler, ScaledTableUpdates(kernels), group, self.root_device)
        )
        if self._check_finite and self._finite is None:
            self._finite = FiniteGuard(kernels)
        if self._pipeline_on and self.sharded and (self.pipeline is None or self.pipeline.closed):
            env = new_group_like(next(iter(self.sharded.values())).env, self._timeout)  # collective
            self._own_groups.append(env.pg)  # type: ignore[arg-type]
            self.pipeline = TrainPipeline(self.sharded, env, self.root_device)

    def _torchrec_config(self, module: torch.nn.Module) -> FusedOptimConfig | None:
        """The fused config TorchRec's ways set (``apply_optimizer_in_backward``, sharders' ``fused_params``);
        None when neither is used. Conflicts with ``embedding_optimizer`` are refused by name."""
        uses = bool(in_backward_tables(module, self._sharders))
        if not uses:
            return None
        return resolve_fused_config(module, self._embedding_optimizer, self._sharders, "ShardRecStrategy")

    def _fused_config(self, holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None) -> FusedOptimConfig:
        if self._migrated is not None:
            config = self._migrated
        elif self._embedding_optimizer is not None:
            config = self._embedding_optimizer
        elif holder is not None:
            config = derive_fused_config(*holder)
        else:
            config = FusedOptimConfig()
        if self._embedding_lr is not None:
            config = FusedOptimConfig(**{**config.__dict__, "lr": self._embedding_lr})
        return config

    def _fit_guards(self, trainer: Any, holder: tuple[torch.optim.Optimizer, dict[str, Any]] | None) -> None:
        """At every fit: report (or, strict, refuse) each table's rule; clip fused rows by value or refuse norm."""
        groups = [g for s in self.sharded.values() for g in s._groups()]
        fused = sorted({t.config.name for g in groups if g.fused for t in g.tables})
        dense = sorted({t.config.name for g in groups if not g.fused for t in g.tables})
        explicit = self._embedding_optimizer is not None or self._embedding_lr is not None
        rank_zero_info(rule_report(holder, self._config, explicit, fused, dense, self._strict_optimizer))
        if fused and self._deferral is not None:  # clipping done at the step (lightning/deferred.py)
            rank_zero_info(deferral_line(self._deferral))
            self._to_torch_kernels()
            for k in (k for s in self.sharded.values() for k in s.kernels()):
                k.grad_clip_value = None
            return
        clip = guards.fused_clip_value(trainer) if fused else None
        if clip is not None:
            self._to_torch_kernels()  # clamps rows; fbgemm's TBE cannot
            for k in (k for s in self.sharded.values() for k in s.kernels()):
                k.grad_clip_value = clip
        if fused:
            guards.guard_clipping(self.precision_plugin, clip)

    def _to_torch_kernels(self) -> None:
        for coll in self.sharded.values():
            if any(k.backend is not KernelBackend.TORCH for k in coll.kernels()):
                coll.rebuild_kernels(self._config, KernelBackend.TORCH)
                self.fused_optimizer = None

    def _adopt(self, module: torch.nn.Module) -> None:
        """Take over the collections another ShardRecStrategy sharded (a second Trainer on the same model)."""
        self.sharded = {n: m for n, m in module.named_modules() if isinstance(m, ShardedCollection)}
        origin = getattr(next(iter(self.sharded.values()), None), "shardrec_origin", None)
        if origin is not None:
            self.plan, self._holder_slot, self._config = origin

    def _shard(self, module: torch.nn.Module, config: FusedOptimConfig) -> None:
        self._config = config
        fused_tables = in_backward_tables(module, self._sharders)  # TorchRec's optimizer settings: planned fused
        local = ranks_per_host(dist.get_world_size(), self.num_nodes, self.num_processes)  # Lightning's hosts
        env = ShardingEnv.from_process_group(local_world_size=local)
        env = attach(env, self._comm_transport)  # collective; waits as long as the group's timeout
        self.topology = topology = Topology.from_process_group(
            compute_device=self.root_device.type, local_world_size=local
        )
        planner = EmbeddingShardingPlanner(
            topology,
            batch_size=self._planner_batch_size,
            constraints=fused_only(fused_tables, self._constraints),
            optimizer=config.optimizer,
            reserve=self._planner_reserve,
        )
        self.plan = planner.collective_plan(module, fixed=self._fixed_plan)  # type: ignore[arg-type]
        setup = KernelSetup(
            optim=config,
            backend=KernelBackend.TORCH if self._deferral else self._kernel,  # deferred: torch kernels
            device=self.root_device,
            batch_size=self._planner_batch_size,
            pooling=pooling_of(self._constraints),
            comm_precision=self._comm_precision,
        )
        self.sharded = shard_modules(module, self.plan, env, setup)
        check_fused(fused_tables, self.sharded)
        _print_plan(self.plan, kernel_labels(self.sharded), self._deferral)
        _print_transport(env)  # collective

    def _wrap_dense(self, model: torch.nn.Module) -> torch.nn.Module:
        fused: list[str] = []
        for path, sharded in self.sharded.items():
            for i, group in enumerate(sharded.groups):
                if group.fused:
                    prefix = f"{path}.groups.{i}"
                    fused += [n for n, _ in group.named_parameters(prefix=prefix)]
                    fused += [n for n, _ in group.named_buffers(prefix=prefix)]
            if hasattr(sharded, _ANCHOR):
                fused.append(f"{path}.{_ANCHOR}")
        skip = set(fused)
        if not any(p.requires_grad for n, p in model.named_parameters() if n not in skip):
            return model
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, fused)
        # Its own group: DDP's hook-driven all-reduces never interleave with the tables' collectives.
        # A repeated fit() reuses it; teardown destroys it (lightning/teardown.py), and the next fit makes another.
        if not live_group(getattr(self, "_dense_pg", None)):
            self._dense_pg = dist.new_group(backend=self._get_process_group_backend(), timeout=self._timeout)
            self._own_groups.append(self._dense_pg)
        ddp = DistributedDataParallel(
            model, device_ids=self.determine_ddp_device_ids(), process_group=self._dense_pg, **self._ddp_kwargs
        )
        transport = next(iter(self.sharded.values())).env.transport
        if transport is not None:  # every rank alike: the dense all-reduce through shared memory too
            self._dense_transport = use_shm_allreduce(ddp, self._dense_pg)  # closed in teardown
        return ddp

    def collective(self) -> AbstractContextManager[None]:
        """Enter on every rank to call the sharded model outside the Trainer's loops (same calls on every rank)."""
        return nullcontext() if self.guard is None else self.guard.collective()

    # --- pipeline (pipeline=True): logic in lightning_shardrec.lightning.pipeline ----------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            self.pipeline.before_step(self.lightning_module.trainer, super().batch_to_device)  # type: ignore[union-attr]
        return super().training_step(*args, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        moved = None if self.pipeline is None or device is not None else self.pipeline.moved(batch)
        return super().batch_to_device(batch, device, dataloader_idx) if moved is None else moved

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._deferred_glue is not None:
            return self._deferred_glue.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)
        if self._scaler_glue is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self._scaler_glue.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._finite is not None:
            check_loss(closure_loss, self.lightning_module.trainer.global_step)  # type: ignore[union-attr]
        if self.pipeline is not None:
            self.pipeline.progress()
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._finite is not None:
            self._finite.check_rows()
        if self.pipeline is not None:
            self.pipeline.after_backward()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.world_size > 1 and dist.is_initialized():
            if self._sigterm is None:
                group = dist.new_group(backend=self._get_process_group_backend(), timeout=self._timeout)  # collective
                self._sigterm = LaggedSigterm(group, self.root_device)
            self._sigterm.install(self.lightning_module.trainer)  # type: ignore[union-attr]
        if self.world_size > 1 and self._deadline is None:  # SIGTERM ends this rank, also inside a collective
            self._deadline = SigtermDeadline(self.global_rank)
            self._deadline.install(self.lightning_module.trainer)  # type: ignore[union-attr]

    @override
    def on_train_end(self) -> None:
        if self.pipeline is not None:
            self.pipeline.drain()
        if self._sigterm is not None:
            self._sigterm.remove()
        super().on_train_end()

    # --- teardown (failures: lightning_shardrec.lightning.rank_failures) ------------------------
    @override
    def teardown(self) -> None:
        if self._deadline is not None:  # left fit: no SIGTERM deadline
            self._deadline.remove()
            self._deadline = None
        if self._sigterm is not None:  # after a failure too: give the loop its check back, wait for nobody
            self._sigterm.remove(wait=False)
            self._sigterm.close()
            self._sigterm = None
        self.stop_monitor()
        if self._finite is not None:
            self._finite.remove()
            self._finite = None
        guards.unguard_clipping(self.precision_plugin)
        if self._scaler_glue is not None:  # kept (skipped_steps) until the next fit replaces it
            self._scaler_glue.updates.detach()
        if self._deferred_glue is not None:  # kept (skipped_steps) until the next fit replaces it
            self._deferred_glue.updates.detach()
        if not self.sharded and not has_meta_tables(self.lightning_module):  # meta: a refused plan, nothing to move
            return super().teardown()
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        if self._dense_transport is not None:  # with its DDP wrapper (the next fit connects another)
            self._dense_transport.close()
            self._dense_transport = None
        if self.pipeline is not None and not self._failing:
            self.pipeline.close()  # prefetch off, its transport closed: its group goes next
        if not self._failing:  # after a failure a group may hold work for a dead peer: leave it to exit
            destroy_groups(self._own_groups)
            self._own_groups = []
        # Unlike the base class, do not copy (possibly huge) sharded tables to the CPU.
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Sharded embedding tables (TorchRec-style) + DDP for dense layers"
            )


_ANCHOR = "shardrec_anchor"  # an empty parameter per sharded collection; its param group trains the fused tables


def _fused_params(coll: ShardedCollection) -> list[torch.nn.Parameter]:
    anchor = [getattr(coll, _ANCHOR)] if hasattr(coll, _ANCHOR) else []
    return anchor + [p for g in coll.groups if g.fused for p in g.parameters()]


@rank_zero_only
def _print_plan(plan: ShardingPlan, kernels: dict[tuple[str, str], str], deferral: str | None) -> None:
    peak = "" if plan.stats is None else "\n" + peak_line(plan.stats.max_storage, plan.stats.storage_cap)
    note = "" if deferral is None else "\n" + deferral_line(deferral)
    print(f"lightning_shardrec sharding plan:\n{plan.table(kernels)}{peak}{note}", flush=True)


def _print_transport(env: ShardingEnv) -> None:
    """Collective: rank 0 prints the hosts x ranks the plan assumed and each host's transport."""
    report = transport_report(env)
    if env.rank == 0:
        print(report, flush=True)


@rank_zero_only
def _save_plan(plan: ShardingPlan | None, dirpath: str | None) -> None:
    """``sharding_plan.json`` beside the checkpoints (edit it and pass it back as ``plan=`` to pin it)."""
    if plan is None or not dirpath:
        return
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(dirpath, "sharding_plan.json"), "w") as f:
        f.write(plan.to_json())


ShardRecStrategy.register_strategies(StrategyRegistry)
