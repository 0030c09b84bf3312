"""``ShardRecStrategy`` (``strategy="shardrec"``): shard embedding tables, DDP the rest.

A thin layer over Lightning's ``DDPStrategy`` whose hooks hand off to plain objects built from
:class:`~lightning_shardrec.lightning.strategies.options.ShardRecOptions`, the same ones the Fabric strategy
(:mod:`~lightning_shardrec.lightning.strategies.fabric`) holds: ``tables`` (planner step, sharding, fused
optimizer), ``dense`` (DDP on its own group), ``checkpoints``, ``failures`` (rank failures),
``updates`` (the step's table updates under precision, deferral, NaN checks), ``signals``.
"""

from __future__ import annotations

import signal
from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import fields
from datetime import timedelta
from inspect import signature
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.distributed.comm.groups import new_group_like
from lightning_shardrec.distributed.comm.same_host import use_shm_allreduce
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder
from lightning_shardrec.errors import IdOutOfRangeError
from lightning_shardrec.lightning.checkpoints.after_fit import gather_to_rank_zero
from lightning_shardrec.lightning.checkpoints.checkpoint_io import ShardRecCheckpointIO, resumable
from lightning_shardrec.lightning.checkpoints.checkpointing import ShardedCheckpoints, default_io, remote
from lightning_shardrec.lightning.failures.data_errors import explain_bad_id
from lightning_shardrec.lightning.failures.rank_failures import FailureHandling
from lightning_shardrec.lightning.failures.signals import FitSignals
from lightning_shardrec.lightning.failures.teardown import destroy_default_group_at_exit
from lightning_shardrec.lightning.parameters.dense import DenseReplicas
from lightning_shardrec.lightning.parameters.fused_params import add_anchors, fused_params
from lightning_shardrec.lightning.parameters.optimizers import Holder
from lightning_shardrec.lightning.parameters.table_memory import has_meta_tables, tables_hidden
from lightning_shardrec.lightning.parameters.tables import ShardedTables
from lightning_shardrec.lightning.parameters.updates import StepUpdates
from lightning_shardrec.lightning.pl_compat import attached_trainer, optimizers_to_device
from lightning_shardrec.lightning.reports import summary
from lightning_shardrec.lightning.reports.dynamic_monitor import add_dynamic_monitor
from lightning_shardrec.lightning.reports.plan_report import save_plan
from lightning_shardrec.lightning.strategies.cluster import ranks_per_host
from lightning_shardrec.lightning.strategies.options import ShardRecOptions, with_strategy_args
from lightning_shardrec.lightning.training import guards
from lightning_shardrec.lightning.training.control import ControlGroup
from lightning_shardrec.lightning.training.deferred import deferral_reason
from lightning_shardrec.lightning.training.pipeline import TrainPipeline, prefetch_line
from lightning_shardrec.lightning.training.precision import convert_dense
from lightning_shardrec.lightning.training.uneven import BatchPadding, is_empty, zero_loss
from lightning_shardrec.modules.table_init import tables_on_meta
from lightning_shardrec.planner import ParameterConstraints, ParameterSharding, ShardingPlan
from lightning_shardrec.planner.machine.memory import DEFAULT_RESERVE


def _held(part: str, name: str, settable: bool = False) -> Any:
    """A property for ``self.<part>.<name>`` (read, and written where ``settable``)."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=f"``self.{part}.{name}``")


class ShardRecStrategy(DDPStrategy):
    """Embedding tables sharded and trained in backward; dense layers data-parallel. Takes ``DDPStrategy``'s
    process-group arguments and the options of
    :class:`~lightning_shardrec.lightning.strategies.options.ShardRecOptions`."""

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
        pipeline: bool | None = None,
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
        full_tables_after_fit: bool | None = None,
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
        # Lightning's public seam for checkpoint I/O; a plugin given to the Trainer replaces it
        self.checkpoint_io = ShardRecCheckpointIO(refuse_resume=False)
        self.tables = ShardedTables(self.options)  # planner step, sharding, fused optimizer
        self.checkpoints = ShardedCheckpoints(self.tables, self)
        self.failures = FailureHandling(self.options.heartbeat_timeout, kill=self._kill_launched)  # rank failures
        self.updates = StepUpdates(lambda: self.root_device, lambda: self.precision_plugin)
        self.control = ControlGroup(timeout)  # gloo, CPU: every control flag (lightning/training/control.py)
        self.padding = BatchPadding(self.control)  # uneven training data (lightning/training/uneven.py)
        self.pipeline: TrainPipeline | None = None
        self.signals = FitSignals()  # SIGTERM during a multi-rank fit (lightning/failures/signals.py)
        self.dense = DenseReplicas(self._new_group, lambda ddp, pg: use_shm_allreduce(ddp, pg))  # read at each fit
        self.guard: guards.ShardedGuard | None = None
        self._deferral: str | None = None  # why this fit's table updates wait for the optimizer step

    sharded = _held("tables", "sharded", settable=True)
    plan = _held("tables", "plan")
    topology = _held("tables", "topology")
    fused_optimizer = _held("tables", "fused_optimizer", settable=True)
    _config = _held("tables", "config")
    monitor = _held("failures", "monitor", settable=True)
    _failing = _held("failures", "failing", settable=True)
    _dense_transport = _held("dense", "transport")
    _deferred_glue = _held("updates", "deferred_glue")
    _scaler_glue = _held("updates", "scaler_glue")

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()`` and ``configure_model``: dense layers on the device as usual, the
        collections' tables on ``meta`` (each rank builds only its shards, from the tables' seeds, in setup)."""
        with super().tensor_init_context(empty_init), tables_on_meta():
            yield

    @override
    def setup_distributed(self) -> None:
        created = not dist.is_initialized()
        super().setup_distributed()
        if created and dist.is_initialized():
            destroy_default_group_at_exit()
        local = ranks_per_host(self.world_size, self.num_nodes, self.num_processes)
        self.failures.start(self.global_rank, self.world_size, local)

    def _new_group(self) -> dist.ProcessGroup:
        return dist.new_group(backend=self._get_process_group_backend(), timeout=self._timeout)  # collective

    def _kill_launched(self) -> None:  # the ranks this process launched (Lightning's subprocess launcher)
        if self.launcher is not None:
            self.launcher.kill(signal.SIGKILL)

    @override
    def setup(self, trainer: Any) -> None:
        """Find the tables, (fit) their param group, shard (a later fit: a fresh fused state), (fit) hand the
        tables to the fused optimizer, place the model, (fit) DDP the dense rest, precision, (fit) the step's glue."""
        module = self.lightning_module
        assert module is not None and self.accelerator is not None
        tables = self.tables
        collections = tables.find(module)
        if not collections and not self.sharded:
            rank_zero_info("ShardRecStrategy: the LightningModule has no embedding collection; training as plain DDP")
            return super().setup(trainer)
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._deferral = deferral_reason(trainer, module) if fitting else None  # accumulation, norm clipping
        table_params = [p for c in collections.values() for p in c.parameters()]
        table_params += [p for s in self.sharded.values() for p in fused_params(s)]
        holder = self._table_holder(trainer, collections, table_params) if fitting else None
        if collections:  # plan and shard (collective); the anchor a later configure_optimizers finds them by
            tables.migrated = self.options.torchrec_config(module)
            local = ranks_per_host(dist.get_world_size(), self.num_nodes, self.num_processes)  # Lightning's hosts
            config = self.options.fused_config(holder, tables.migrated)
            tables.shard(module, config, self.root_device, local, deferred=bool(self._deferral))
            add_anchors(self.sharded, self.root_device)
            save_plan(self.plan, getattr(trainer.checkpoint_callback, "dirpath", None))
        elif fitting:  # sharded by validate/test/predict or an earlier fit: fresh fused state, this fit's rule
            tables.renew(self.options.fused_config(holder, tables.migrated))
        if fitting:
            self.checkpoints.groups_before = tables.hand_over(self.optimizers, collections, table_params, holder)
            self.updates.guard_fit(tables, holder, trainer, self._deferral)
            summary.install(trainer, self.sharded)  # Lightning's summary counts the full tables (summary.py)
            if self.options.log_dynamic_stats:
                add_dynamic_monitor(trainer, module)  # every rank: gathering the figures is collective
        convert_dense(self.precision_plugin, self.model, self.sharded)  # tables keep their config's dtype
        self.model_to_device()
        kernels = tables.link(holder)
        if self.guard is None and self.sharded:
            self.guard = guards.ShardedGuard(self.sharded, lambda: attached_trainer(self.lightning_module))
        if fitting and self.model is not None:  # Lightning connected the model before setup
            self.model = self.dense.wrap(self.tables, self.model, self.determine_ddp_device_ids(), **self._ddp_kwargs)
            self._register_ddp_hooks()
        self.setup_precision_plugin()
        if fitting:
            self._fit_helpers(kernels, holder)

    def _table_holder(self, trainer: Any, collections: Mapping[str, Any], table_params: list[Any]) -> Holder | None:
        """Fit: the user's optimizers, built over shapes of the tables (no optimizer state allocated for
        them), and the param group the tables train as (kept across fits)."""
        with tables_hidden([*collections.values(), *self.tables.table_groups(fused=True)], lambda: self.optimizers):
            self.setup_optimizers(trainer)
        return self.tables.pick_holder(self.optimizers, table_params)

    def _fit_helpers(self, kernels: list[Any], holder: Holder | None) -> None:
        """Fit, after precision: optimizers on the device, the step's glue (lightning/parameters/updates.py),
        the pipeline."""
        optimizers_to_device(self.optimizers, self.root_device)
        group = next(iter(self.sharded.values())).env.pg
        deferred = self._deferral is not None and any(g.fused for s in self.sharded.values() for g in s._groups())
        self.updates.attach(kernels, holder, group, deferred, self.options.check_finite)
        pipeline = self.options.pipeline if self.options.pipeline is not None else self.world_size > 1
        if pipeline and self.sharded and (self.pipeline is None or self.pipeline.closed):
            env = new_group_like(next(iter(self.sharded.values())).env, self._timeout)  # collective
            self.dense.own(env.pg)  # type: ignore[arg-type]
            self.pipeline = TrainPipeline(self.sharded, env, self.root_device, by_default=self.options.pipeline is None)
            rank_zero_info(prefetch_line(self.sharded, default=self.options.pipeline is None))

    def collective(self) -> AbstractContextManager[None]:
        """Enter on every rank to call the sharded model outside the Trainer's loops (same calls on every rank)."""
        return nullcontext() if self.guard is None else self.guard.collective()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.updates.new_step()
        try:
            if self.pipeline is not None:  # raises this batch's id error found at its prefetch (named below)
                self.pipeline.before_step(self.lightning_module.trainer, super().batch_to_device)  # type: ignore[union-attr]
            out = super().training_step(*args, **kwargs)
        except IdOutOfRangeError as err:  # name the step and the batch key, and how to get past it
            step = self.lightning_module.trainer.global_step  # type: ignore[union-attr]
            raise explain_bad_id(err, args[0] if args else None, step, args[1] if len(args) > 1 else -1) from None
        return zero_loss(out) if self._pads() and args and is_empty(args[0]) else out  # a padded step: no NaN

    def _pads(self) -> bool:
        return self.options.uneven_batches == "pad" and self.world_size > 1 and bool(self.sharded)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader of a sharded fit on several ranks: padded past its end (lightning/training/uneven.py)."""
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
        return self.updates.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.updates.finite is not None:
            self.updates.check_loss(closure_loss, self.lightning_module.trainer.global_step)  # type: ignore[union-attr]
        if self.pipeline is not None:
            self.pipeline.progress()
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self.updates.check_rows()
        if self.pipeline is not None:
            self.pipeline.after_backward()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.guard is not None:
            self.guard.drop_full()  # the tables change from here on
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        self.signals.start(trainer, self.global_rank, self.world_size, self.control.group)

    @override
    def on_train_end(self) -> None:
        if self.pipeline is not None:
            self.pipeline.drain()
        self.signals.end()
        after_fit = self.options.full_tables_after_fit
        if after_fit is not False and self.guard is not None and dist.is_initialized():  # every rank together:
            # rank 0 keeps the full tables when they fit (lightning/checkpoints/after_fit.py)
            gather_to_rank_zero(self.sharded, self.guard, self.control.group(), after_fit is True)
        super().on_train_end()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # tables are restored into their shards, so the sharded model must exist

    def _dense_state(self) -> dict[str, torch.Tensor]:
        with nullcontext() if self.guard is None else self.guard.allow_state_dict():
            return self.tables.dense_state(self.lightning_module.state_dict())  # type: ignore[union-attr]

    def full_state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """Collective: the unsharded model's state dict (tables gathered in bands) on global rank ``dst`` (``None``:
        every rank; tests, small models); the other ranks get ``{}`` (:meth:`ShardedTables.full_state`)."""
        if not self.sharded:
            return self.lightning_module.state_dict()  # type: ignore[union-attr]
        return self.tables.full_state(self._dense_state(), self.global_rank, dst)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:  # the tables: in save_checkpoint
        return self._dense_state() if self.sharded else super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self.sharded or "state_dict" not in checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.pipeline is not None:
            self.pipeline.patch_loader_states(checkpoint)
        streamed = default_io(self.checkpoint_io) and storage_options is None and not remote(filepath)
        base = super().save_checkpoint  # a custom or remote writer takes the whole checkpoint: rank 0 holds it all
        writer = None if streamed else lambda c: base(c, filepath, storage_options)
        return self.checkpoints.save(checkpoint, filepath, writer=writer, optimizers=self.optimizers)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        return super().remove_checkpoint(filepath) if remote(filepath) else self.checkpoints.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        weights_only = True if weights_only is None else weights_only  # unless the caller trusts the file
        io, base = self.checkpoint_io, super().load_checkpoint
        takes = "weights_only" in signature(base).parameters  # Lightning 2.6; 2.5's does not

        def read() -> dict[str, Any]:
            if isinstance(io, ShardRecCheckpointIO):  # takes weights_only on Lightning 2.5 too
                return resumable(io.load_checkpoint(checkpoint_path, weights_only=weights_only))
            return resumable(base(checkpoint_path, **({"weights_only": weights_only} if takes else {})))

        got, in_place = self.checkpoints.load(checkpoint_path, self._dense_state, weights_only, read, default_io(io))
        return {**got, "state_dict": {}} if in_place else got  # the weights: already loaded in place

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.sharded:
            return super().load_model_state_dict(checkpoint, strict)
        module = self.lightning_module
        return self.checkpoints.load_weights(checkpoint["state_dict"], module, self._dense_state(), strict)  # type: ignore[arg-type]

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return self.checkpoints.load_optimizers(checkpoint, self.optimizers, super().load_optimizer_state_dict)

    def _on_dead_rank(self, rank: int, what: str) -> None:
        self.failures.on_dead_rank(rank, what)

    def stop_monitor(self) -> None:  # the heartbeat thread (teardown, after a failure too)
        self.failures.stop()

    @override
    def on_exception(self, exception: BaseException) -> None:  # the other ranks name this one
        super().on_exception(exception)
        self.failures.on_exception(exception)

    @override
    def teardown(self) -> None:
        summary.remove(attached_trainer(self.lightning_module))
        self.signals.close()  # after a failure too
        self.control.close()  # after a failure too: a gloo group left to interpreter exit can abort it
        self.failures.stop()
        self.updates.detach()  # the clipping guard too
        if not self.sharded and not has_meta_tables(self.lightning_module):  # meta: a refused plan, nothing to move
            return super().teardown()
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        self.dense.unwrap()  # its transport (the next fit connects another)
        if self.pipeline is not None and not self.failures.failing:
            self.pipeline.close()  # prefetch off, its transport closed: its group goes next
        if not self.failures.failing:  # after a failure a group may hold work for a dead peer: leave it to exit
            self.dense.destroy()  # freed: their threads stop
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


ShardRecStrategy.__doc__ = with_strategy_args(ShardRecStrategy.__doc__)
ShardRecStrategy.register_strategies(StrategyRegistry)
