"""``ShardRecStrategy`` (``strategy="shardrec"``): shard embedding tables, DDP the rest.

A thin layer over Lightning's ``DDPStrategy`` (its launchers, cluster environments,
process-group setup, ``barrier``/``reduce``/``all_gather``). What it adds, in
``setup``: plan and shard the module's embedding collections, move the tables out
of the user's optimizer into the fused in-backward optimizer (derived from the
user's, lr linked so schedulers move both), and wrap only the dense rest in DDP.
Options: :mod:`lightning_shardrec.lightning.options`;
checkpoints: :mod:`lightning_shardrec.lightning.checkpointing`; rank failures:
:mod:`lightning_shardrec.lightning.rank_failures` (on :mod:`lightning_shardrec.distributed.health.heartbeats`);
NaN checks: :mod:`lightning_shardrec.kernels.finite`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import fields
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_shardrec._compat import torch as compat
from lightning_shardrec._compat.lightning import attached_trainer, optimizers_to_device
from lightning_shardrec.checkpoint import param_layout, table_parameter_keys
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.groups import live_group, new_group_like
from lightning_shardrec.distributed.comm.same_host import attach_transport, use_shm_allreduce
from lightning_shardrec.distributed.comm.transport import Transport
from lightning_shardrec.distributed.dmp.dmp_settings import check_fused, in_backward_tables, undecided_tables
from lightning_shardrec.distributed.dmp.model_parallel import find_collections, kernel_labels, shard_modules
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.errors import IdOutOfRangeError
from lightning_shardrec.kernels import KernelBackend
from lightning_shardrec.kernels.finite import FiniteGuard, check_loss
from lightning_shardrec.lightning import guards
from lightning_shardrec.lightning.after_fit import gather_to_rank_zero
from lightning_shardrec.lightning.cluster import ranks_per_host
from lightning_shardrec.lightning.data_errors import explain_bad_id
from lightning_shardrec.lightning.deferred import DeferredGlue, deferral_line, deferral_reason, watch_repeats
from lightning_shardrec.lightning.dynamic_monitor import add_dynamic_monitor
from lightning_shardrec.lightning.fused_params import add_anchors, fused_names, fused_params
from lightning_shardrec.lightning.optimizers import (
    Holder,
    add_params,
    find_group,
    group_at,
    group_slot,
    remove_params,
    rule_report,
)
from lightning_shardrec.lightning.options import ShardRecOptions
from lightning_shardrec.lightning.pipeline import TrainPipeline, prefetch_line
from lightning_shardrec.lightning.plan_report import print_plan, print_transport, save_plan
from lightning_shardrec.lightning.precision import ScalerGlue, convert_dense
from lightning_shardrec.lightning.rank_failures import RankFailureHandling
from lightning_shardrec.lightning.sigterm import LaggedSigterm, SigtermDeadline
from lightning_shardrec.lightning.table_memory import has_meta_tables, tables_hidden
from lightning_shardrec.lightning.teardown import destroy_groups
from lightning_shardrec.lightning.uneven import BatchPadding, is_empty, zero_loss
from lightning_shardrec.modules.plain_embeddings import swap_embedding_modules
from lightning_shardrec.modules.table_init import tables_on_meta
from lightning_shardrec.optim import FusedOptimizer, RepeatedLookups, ScaledTableUpdates
from lightning_shardrec.planner import ParameterConstraints, ParameterSharding, ShardingPlan, Topology
from lightning_shardrec.planner.memory import DEFAULT_RESERVE


class ShardRecStrategy(RankFailureHandling):
    """Embedding tables sharded and trained in backward; dense layers data-parallel.

    Args:
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
        full_tables_after_fit: gather the full tables to rank 0 at the end of each fit (when they fit), so
            ``model.state_dict()`` and ``model(batch)`` work on rank 0 alone after fit (off by default).

    Each of the strategy's own options is explained in full, and checked, by
    :class:`~lightning_shardrec.lightning.options.ShardRecOptions` (``self.options``).
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
        uneven_batches: Literal["pad", "error"] = "pad",
        full_tables_after_fit: bool = False,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        given = locals()  # the arguments; ShardRecOptions parses and checks those that are its fields
        self.options = ShardRecOptions(**{f.name: given[f.name] for f in fields(ShardRecOptions)})
        self._finite: FiniteGuard | None = None
        self.pipeline: TrainPipeline | None = None
        self._sigterm: LaggedSigterm | None = None  # Lightning's per-batch SIGTERM broadcast, made async
        self._deadline: SigtermDeadline | None = None  # SIGTERM ends a rank within seconds (lightning/sigterm.py)
        self._own_groups: list[dist.ProcessGroup] = []  # destroyed in teardown (lightning/teardown.py)
        self._dense_transport: Transport | None = None  # the DDP hook's (closed in teardown)
        self._holder_slot: tuple[int, int] | None = None  # the param group the tables train as, across fits
        self._migrated: FusedOptimConfig | None = None  # set by apply_optimizer_in_backward / sharders
        self.guard: guards.ShardedGuard | None = None
        self._loaded_in_place = False
        self.sharded: dict[str, ShardedCollection] = {}
        self.plan: ShardingPlan | None = None
        self.topology: Topology | None = None  # what the planner assumed (hosts from num_nodes x devices)
        self.fused_optimizer: FusedOptimizer | None = None
        self._scaler_glue: ScalerGlue | None = None  # "16-mixed": table updates follow the GradScaler
        self._deferral: str | None = None  # why this fit's table updates wait for the optimizer step
        self._deferred_glue: DeferredGlue | None = None
        self._repeats: RepeatedLookups | None = None  # a table looked up twice in a step: summed (deferred.py)
        self.padding = BatchPadding(timeout)  # uneven training data (lightning/uneven.py)

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
        table_params += [p for s in self.sharded.values() for p in fused_params(s)]
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
        swap_embedding_modules(module, self.options.embedding_modules, self.options.embedding_min_rows)
        collections = find_collections(module)
        if not collections and not self.sharded:
            self._adopt(module)  # sharded by an earlier Trainer's strategy
        return collections

    def _table_holder(
        self, trainer: Any, collections: Mapping[str, torch.nn.Module], table_params: list[torch.nn.Parameter]
    ) -> Holder | None:
        """Fit: the user's optimizers, built over shapes of the tables (no optimizer state allocated for
        them), and the param group the tables train as (kept across fits)."""
        fused = [g for s in self.sharded.values() for g in s.groups if g.fused]
        with tables_hidden([*collections.values(), *fused], lambda: self.optimizers):
            self.setup_optimizers(trainer)
        holder = find_group(self.optimizers, table_params)
        holder = holder or group_at(self.optimizers, self._holder_slot)  # a later fit: tables not in it
        self._holder_slot = group_slot(self.optimizers, holder)
        return holder

    def _shard_collections(self, trainer: Any, module: torch.nn.Module, holder: Holder | None) -> None:
        """Plan and shard (collective); each collection gets the anchor its param group is found by."""
        self._migrated = self.options.torchrec_config(module)
        self._shard(module, self.options.fused_config(holder, self._migrated))
        add_anchors(self.sharded, self.root_device)  # the param group a later configure_optimizers puts it in
        save_plan(self.plan, getattr(trainer.checkpoint_callback, "dirpath", None))

    def _renew_fused_state(self, holder: Holder | None) -> None:
        """A fit on collections sharded before: this fit's rule, a fresh fused state."""
        self._config = self.options.fused_config(holder, self._migrated)
        self.fused_optimizer = None
        for coll in self.sharded.values():
            coll.rebuild_kernels(self._config)

    def _hand_tables_to_fused(
        self,
        trainer: Any,
        module: LightningModule,
        collections: Mapping[str, torch.nn.Module],
        table_params: list[torch.nn.Parameter],
        holder: Holder | None,
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
            add_params(holder, dense_tables)  # data-parallel tables train like dense layers
        self._fit_guards(trainer, holder)
        if self.options.log_dynamic_stats:
            add_dynamic_monitor(trainer, module)  # every rank: gathering the figures is collective

    def _place_model(self, holder: Holder | None) -> list[Any]:
        """Dense precision, the model on its device, the fused optimizer (lr linked to the holder's group),
        the origin a later Trainer adopts, the collective-call guard; the kernels of every table group."""
        convert_dense(self.precision_plugin, self.model, self.sharded)  # tables keep their config's dtype
        self.model_to_device()
        kernels = [k for s in self.sharded.values() for k in s.kernels()]
        if self.fused_optimizer is None:
            self.fused_optimizer = FusedOptimizer(kernels, self._config)
        if holder is not None:  # the tables' lr follows the group's schedule (read live: survives a resume)
            self.fused_optimizer.link_lr(holder[0], [id(g) for g in holder[0].param_groups].index(id(holder[1])))
        for coll in self.sharded.values():  # for a later Trainer's strategy (see _adopt)
            coll.shardrec_origin = (self.plan, self._holder_slot, self._config)  # type: ignore[assignment]
        if self.guard is None and self.sharded:
            self.guard = guards.ShardedGuard(self.sharded, lambda: attached_trainer(self.lightning_module))
        return kernels

    def _fit_helpers(self, kernels: list[Any], holder: Holder | None) -> None:
        """Fit, after precision: optimizers on the device, the GradScaler glue, the finite guard, the pipeline."""
        optimizers_to_device(self.optimizers, self.root_device)
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
        self._repeats = watch_repeats(self, kernels, holder, group)
        if self.options.check_finite and self._finite is None:
            self._finite = FiniteGuard(kernels)
        if self.options.pipeline and self.sharded and (self.pipeline is None or self.pipeline.closed):
            env = new_group_like(next(iter(self.sharded.values())).env, self._timeout)  # collective
            self._own_groups.append(env.pg)  # type: ignore[arg-type]
            self.pipeline = TrainPipeline(self.sharded, env, self.root_device)
            rank_zero_info(prefetch_line(self.sharded))

    def _fit_guards(self, trainer: Any, holder: Holder | None) -> None:
        """At every fit: report (or, strict, refuse) each table's rule; clip fused rows by value or refuse norm."""
        groups = [g for s in self.sharded.values() for g in s._groups()]
        fused = sorted({t.config.name for g in groups if g.fused for t in g.tables})
        dense = sorted({t.config.name for g in groups if not g.fused for t in g.tables})
        explicit, strict = self.options.sets_fused_rule(), self.options.strict_optimizer
        rank_zero_info(rule_report(holder, self._config, explicit, fused, dense, strict))
        if fused and self._deferral is not None:  # clipping done at the step (lightning/deferred.py)
            rank_zero_info(deferral_line(self._deferral))
            self._clip_rows(None)
            return
        clip = guards.fused_clip_value(trainer) if fused else None
        if clip is not None:
            self._clip_rows(clip)
        if fused:
            guards.guard_clipping(self.precision_plugin, clip)

    def _clip_rows(self, clip: float | None) -> None:
        """Torch kernels for every table group (they clamp rows; fbgemm's TBE cannot), clamping at ``clip``."""
        for coll in self.sharded.values():
            if any(k.backend is not KernelBackend.TORCH for k in coll.kernels()):
                coll.rebuild_kernels(self._config, KernelBackend.TORCH)
                self.fused_optimizer = None
        for k in (k for s in self.sharded.values() for k in s.kernels()):
            k.grad_clip_value = clip

    def _adopt(self, module: torch.nn.Module) -> None:
        """Take over the collections another ShardRecStrategy sharded (a second Trainer on the same model)."""
        self.sharded = {n: m for n, m in module.named_modules() if isinstance(m, ShardedCollection)}
        origin = getattr(next(iter(self.sharded.values()), None), "shardrec_origin", None)
        if origin is not None:
            self.plan, self._holder_slot, self._config = origin

    def _shard(self, module: torch.nn.Module, config: FusedOptimConfig) -> None:
        self._config = config
        fused_tables = in_backward_tables(module, self.options.sharders)  # TorchRec's optimizer settings: fused
        undecided = undecided_tables(module, fused_tables, self.options.embedding_optimizer)
        local = ranks_per_host(dist.get_world_size(), self.num_nodes, self.num_processes)  # Lightning's hosts
        env = ShardingEnv.from_process_group(local_world_size=local)
        env = attach_transport(env, self.options.comm_transport)  # collective; waits as long as the group's timeout
        self.topology = Topology.from_process_group(compute_device=self.root_device.type, local_world_size=local)
        planner = self.options.planner(self.topology, fused_tables, config)
        self.plan = planner.collective_plan(module, fixed=self.options.plan)  # type: ignore[arg-type]
        setup = self.options.kernel_setup(config, self.root_device, deferred=bool(self._deferral))
        self.sharded = shard_modules(module, self.plan, env, setup)
        check_fused(fused_tables, self.sharded, undecided)
        print_plan(self.plan, kernel_labels(self.sharded), None)  # the deferral line: once, at fit start
        print_transport(env)  # collective

    def _wrap_dense(self, model: torch.nn.Module) -> torch.nn.Module:
        fused = fused_names(self.sharded)  # updated in backward: DDP leaves them alone
        skip = set(fused)
        if not any(p.requires_grad for n, p in model.named_parameters() if n not in skip):
            return model
        compat.ddp_ignore(model, fused)
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
        if self._repeats is not None:
            self._repeats.new_step()
        try:
            out = super().training_step(*args, **kwargs)
        except IdOutOfRangeError as err:  # name the step and the batch key, and how to get past it
            step = self.lightning_module.trainer.global_step  # type: ignore[union-attr]
            raise explain_bad_id(err, args[0] if args else None, step, args[1] if len(args) > 1 else -1) from None
        return zero_loss(out) if self._pads() and args and is_empty(args[0]) else out  # a padded step: no NaN

    def _pads(self) -> bool:
        return self.options.uneven_batches == "pad" and self.world_size > 1 and bool(self.sharded)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader of a sharded fit on several ranks: padded past its end (lightning/uneven.py)."""
        trainer = attached_trainer(self.lightning_module)
        if self._pads() and trainer is not None and trainer.training and dist.is_initialized():
            return self.padding.wrap(dataloader)  # collective: every rank sets up its training loader here
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        moved = None if self.pipeline is None or device is not None else self.pipeline.moved(batch)
        return super().batch_to_device(batch, device, dataloader_idx) if moved is None else moved

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._deferred_glue is not None:
            return self._deferred_glue.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)
        if self._scaler_glue is not None:
            return self._scaler_glue.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._deferred_glue is not None:  # started in this step's closure: a table looked up twice (watch_repeats)
            self._deferred_glue.updates.apply()
        return out

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
        if self.guard is not None:
            self.guard.drop_full()  # the tables change from here on
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
        if self.options.full_tables_after_fit and self.guard is not None and dist.is_initialized():
            # every rank together: rank 0 keeps the full tables
            gather_to_rank_zero(self.sharded, self.guard, self.root_device)  # when they fit (lightning/after_fit.py)
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
        if self._repeats is not None:
            self._repeats.detach()
            self._repeats = None
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
            self.padding.close()
            destroy_groups(self._own_groups)
            self._own_groups, self._dense_pg = [], None  # freed: their threads stop
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


ShardRecStrategy.register_strategies(StrategyRegistry)
