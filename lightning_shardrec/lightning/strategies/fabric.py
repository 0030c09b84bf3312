"""``ShardRecFabricStrategy`` (``Fabric(strategy="shardrec")``): the Trainer strategy's sharding under Fabric.

Lightning's own strategies come in pairs over one implementation (``lightning.fabric.strategies.ddp``
under ``lightning.pytorch.strategies.ddp``); so do ours: this class holds the same plain objects as
:class:`~lightning_shardrec.lightning.ShardRecStrategy`, built from the same
:class:`~lightning_shardrec.lightning.strategies.options.ShardRecOptions`: ``tables`` (planner step, sharding,
fused optimizer), ``dense`` (DDP on its own group), ``checkpoints`` (the same sharded or full
checkpoints) and ``failures`` (rank failures named)::

    fabric = L.Fabric(strategy="shardrec", devices=2)   # or strategy=ShardRecFabricStrategy(kernel="torch")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)   # plans, shards, moves the tables out of `optimizer`
    loss = loss_fn(model(batch)); fabric.backward(loss)  # the tables are updated in backward
    optimizer.step()                                    # the dense rest (DDP)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})  # a DCP directory by default
    fabric.load(path, state)                            # any world size

``setup`` takes the model and its optimizers together (the tables' update rule is derived from
the optimizer's param group that holds them, and its lr follows that group's scheduler). Each
rank feeds its own part of the global batch, as with DDP. Between two optimizer steps each table
is looked up once (one call with all ids): the fused update runs in each lookup's backward, so a
second lookup in a step (or gradient accumulation) raises ``RepeatedLookupError`` rather than
train differently from one process; the Trainer's strategy sums such lookups instead.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import fields
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_shardrec.errors import RepeatedLookupError
from lightning_shardrec.lightning.checkpoints.checkpoint_io import ShardRecCheckpointIO
from lightning_shardrec.lightning.checkpoints.checkpointing import FUSED_KEY, ShardedCheckpoints, default_io, remote
from lightning_shardrec.lightning.failures.rank_failures import FailureHandling
from lightning_shardrec.lightning.failures.teardown import destroy_default_group_at_exit, release_at_exit
from lightning_shardrec.lightning.parameters.dense import DenseReplicas
from lightning_shardrec.lightning.parameters.optimizers import rule_report
from lightning_shardrec.lightning.parameters.tables import ShardedTables
from lightning_shardrec.lightning.pl_compat import FABRIC_SETUP_TAKES_SCHEDULER
from lightning_shardrec.lightning.strategies.cluster import ranks_per_host
from lightning_shardrec.lightning.strategies.options import ShardRecOptions, with_strategy_args
from lightning_shardrec.optim import RepeatedLookups

#: the options that act on the Trainer's loop only (a value other than the default is refused under Fabric)
TRAINER_ONLY = {"pipeline": None, "uneven_batches": "pad", "full_tables_after_fit": False}


class ShardRecFabricStrategy(DDPStrategy):
    """Embedding tables sharded and trained in backward, dense layers data-parallel, under Fabric. Takes
    Fabric's ``DDPStrategy`` arguments and the options of
    :class:`~lightning_shardrec.lightning.strategies.options.ShardRecOptions`
    as keywords; ``pipeline``, ``uneven_batches`` and ``full_tables_after_fit`` (the Trainer's loop) keep their
    defaults, ``log_dynamic_stats`` logs nothing."""

    strategy_name = "shardrec"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=10),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        valid = [f.name for f in fields(ShardRecOptions)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TypeError(f"ShardRecFabricStrategy: unknown option(s) {unknown}; valid: {valid}")
        off = {"pipeline": False}  # saying no to a loop feature is fine too
        loop_only = sorted(k for k, d in TRAINER_ONLY.items() if options.get(k, d) not in (d, off.get(k, d)))
        if loop_only:
            raise ValueError(
                f"ShardRecFabricStrategy: {loop_only} act on the Trainer's loop; under Fabric leave them at their "
                f"defaults {[TRAINER_ONLY[k] for k in loop_only]} (or train with Trainer(strategy='shardrec'))"
            )
        self.options = ShardRecOptions(**options)
        self.tables = ShardedTables(self.options)
        self.dense = DenseReplicas(self._new_group)
        self.checkpoints = ShardedCheckpoints(self.tables, self)
        self.failures = FailureHandling(self.options.heartbeat_timeout, kill=self._kill_launched)
        self.repeats: RepeatedLookups | None = None
        self.module: torch.nn.Module | None = None  # the model set up (its tables sharded)

    @property
    @override
    def checkpoint_io(self) -> Any:
        if self._checkpoint_io is None:  # the Trainer strategy's plugin: also reads sharded directories
            self._checkpoint_io = ShardRecCheckpointIO(refuse_resume=False)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @override
    def setup_environment(self) -> None:
        created = not dist.is_initialized()
        super().setup_environment()
        if created and dist.is_initialized():
            destroy_default_group_at_exit()
        local = ranks_per_host(self.world_size, self.num_nodes, self.num_processes)
        self.failures.start(self.global_rank, self.world_size, local)
        release_at_exit(self)  # a script need not call teardown: its threads and groups go at exit all the same

    def _new_group(self) -> dist.ProcessGroup:
        return dist.new_group(backend=self._get_process_group_backend(), timeout=self._timeout)  # collective

    def _kill_launched(self) -> None:  # the ranks this process launched (Lightning's subprocess launcher)
        kill = getattr(self.launcher, "kill", None)
        if kill is not None:
            kill(signal.SIGKILL)

    # --- setup: the same steps as the Trainer strategy's ---------------------------------------------
    @override
    def module_to_device(self, module: torch.nn.Module) -> None:
        if not self.tables.find(module):  # unsharded tables: placed shard by shard in setup, not whole
            module.to(self.root_device)

    @override
    def setup_module_and_optimizers(  # type: ignore[override]
        self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[Any, ...]:
        """Plan and shard the tables (collective), move them from the optimizers into the fused optimizer
        (lr linked to their param group), the model on its device, the dense rest in DDP."""
        tables = self.tables
        collections = tables.find(module)
        if not collections and tables.sharded:
            raise RuntimeError(
                "ShardRecFabricStrategy: the model's tables were sharded by an earlier fabric.setup; set a model up "
                "once per strategy (a new Fabric for a new model)"
            )
        if not collections:
            rank_zero_info("ShardRecFabricStrategy: the model has no embedding collection; training as plain DDP")
            with_scheduler = (scheduler,) if FABRIC_SETUP_TAKES_SCHEDULER else ()
            return super().setup_module_and_optimizers(module, optimizers, *with_scheduler)  # type: ignore[call-arg]
        table_params = [p for c in collections.values() for p in c.parameters()]
        holder = tables.pick_holder(optimizers, table_params)
        tables.migrated = self.options.torchrec_config(module)
        local = ranks_per_host(dist.get_world_size(), self.num_nodes, self.num_processes)
        tables.shard(module, self.options.fused_config(holder, tables.migrated), self.root_device, local)
        self.checkpoints.groups_before = tables.hand_over(optimizers, collections, table_params, holder)
        groups = [g for s in tables.sharded.values() for g in s._groups()]
        fused = sorted({t.config.name for g in groups if g.fused for t in g.tables})
        dense = sorted({t.config.name for g in groups if not g.fused for t in g.tables})
        assert tables.config is not None
        explicit, strict = self.options.sets_fused_rule(), self.options.strict_optimizer
        rank_zero_info(rule_report(holder, tables.config, explicit, fused, dense, strict))
        module.to(self.root_device)
        kernels = tables.link(holder)
        self.repeats = OneLookupPerStep(kernels, lambda: None)
        self.module = module
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]  # as Fabric's DDP
        wrapped = self.dense.wrap(tables, module, device_ids, **self._ddp_kwargs)
        return (wrapped, optimizers, scheduler) if FABRIC_SETUP_TAKES_SCHEDULER else (wrapped, optimizers)

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]  # DDP or the model
        """The model alone (evaluation): sharded with ``embedding_optimizer`` (default: the fused default)."""
        if not self.tables.find(module) and not self.tables.sharded:
            return super().setup_module(module)  # no tables: plain DDP
        return self.setup_module_and_optimizers(module, [])[0]

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        if self.repeats is not None:
            self.repeats.new_step()  # the next lookups belong to the next step
        return out

    # --- checkpoints: the Trainer strategy's (lightning_shardrec.lightning.checkpoints.checkpointing) --------------
    def _model_key(self, state: Any) -> str | None:
        """The entry of ``state`` holding the model whose tables are sharded."""
        if not isinstance(state, dict) or self.module is None:
            return None
        return next((k for k, v in state.items() if _unwrapped(v) is self.module), None)

    def _dense_state(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        return self.tables.dense_state(self.module.state_dict())

    def full_state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """Collective: the unsharded model's state dict (tables gathered) on rank ``dst`` (``None``: every rank)."""
        assert self.module is not None, "call fabric.setup(model, optimizer) first"
        return self.tables.full_state(self._dense_state(), self.global_rank, dst)

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Collective: ``state`` with the sharded model's tables (sharded: a DCP directory at ``path``; full:
        one file), the plan and the fused state; every other entry as Fabric saves it."""
        key = self._model_key(state)
        if key is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        if filter is not None and key in filter:
            raise ValueError(
                f"ShardRecFabricStrategy.save_checkpoint: a filter on the sharded model {key!r} is not supported (its "
                "tables are saved shard by shard, whole); filter the other entries, or save a full_state_dict() subset"
            )
        checkpoint = {k: self._state_of(v) for k, v in state.items() if k != key}
        for name, keep in (filter or {}).items():  # as Fabric filters: the entries of a state dict
            if isinstance(checkpoint.get(name), dict):
                checkpoint[name] = {k: v for k, v in checkpoint[name].items() if keep(k, v)}
        checkpoint[key] = self._dense_state()
        streamed = default_io(self.checkpoint_io) and storage_options is None and not remote(path)

        def write(full: dict[str, Any]) -> None:  # a custom or remote writer: rank 0 holds every table
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(full, path, storage_options=storage_options)

        return self.checkpoints.save(checkpoint, path, weights_key=key, writer=None if streamed else write)

    def _state_of(self, obj: Any) -> Any:
        """What Fabric saves of ``obj``: a module's or an optimizer's state dict, a stateful object's, else itself."""
        if isinstance(obj, torch.nn.Module):
            return self.get_module_state_dict(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return self.get_optimizer_state(obj)
        return obj.state_dict() if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") else obj

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Collective: the sharded model's tables and dense rest (any world size, either format), the fused
        state, and every other entry of ``state`` as Fabric restores it; returns what was not restored."""
        key = self._model_key(state)
        if key is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        trusted = True if weights_only is None else weights_only

        def read() -> dict[str, Any]:
            return self.checkpoint_io.load_checkpoint(path, weights_only=trusted)

        got, in_place = self.checkpoints.load(path, self._dense_state, trusted, read, may_map=False)
        missing = sorted(k for k in state if k != key and k not in got)
        if strict and missing:
            raise KeyError(
                f"ShardRecFabricStrategy: checkpoint '{path}' has no {missing}, which the state to restore holds "
                "(pass strict=False to restore the rest)"
            )
        weights = got.pop(key, {})
        if not in_place:
            assert self.module is not None
            self.checkpoints.load_weights(weights, self.module, self._dense_state(), strict)
        self.checkpoints.loaded_in_place = False
        fused = got.pop(FUSED_KEY, None)
        got.pop("shardrec_plan", None)
        if fused is not None:
            self.checkpoints.load_fused(fused)
        for name, obj in state.items():
            if name == key or name not in got:
                continue
            value = got.pop(name)
            if isinstance(obj, torch.nn.Module):
                self.load_module_state_dict(obj, value, strict=strict)
            elif hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):  # optimizers, stateful objects
                obj.load_state_dict(value)
            else:
                state[name] = value
        return got

    # --- failures and teardown ---------------------------------------------------------------------
    def stop_monitor(self) -> None:
        self.failures.stop()

    def release(self) -> None:
        """Stop the health monitor, close the dense all-reduce's transport and destroy the groups made for this
        strategy (not after a failure); idempotent. ``teardown`` runs it, and the exit hook for a script that
        never tears down (:func:`~lightning_shardrec.lightning.failures.teardown.release_at_exit`)."""
        self.failures.stop()
        if self.repeats is not None:
            self.repeats.detach()
            self.repeats = None
        self.dense.unwrap()
        if not self.failures.failing:
            self.dense.destroy()

    @override
    def teardown(self) -> None:
        self.release()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Sharded embedding tables (TorchRec-style) + DDP for dense layers"
            )


def _unwrapped(obj: Any) -> Any:
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


class OneLookupPerStep(RepeatedLookups):
    """Under Fabric a fused table's second lookup between two optimizer steps is refused, whatever its kernel:
    nothing defers its update to the step (the Trainer's strategy does, and sums the lookups)."""

    @override
    def seen(self, kernel: Any) -> None:
        count = self._counts[id(kernel)] = self._counts.get(id(kernel), 0) + 1
        if count == 2 and kernel.row_sink is None:
            names = sorted({t.name.split("[")[0] for t in kernel.tables})  # a shard's name: "item[0:40, 0:8]"
            raise RepeatedLookupError(
                f"ShardRecFabricStrategy: tables {names} were looked up a second time before optimizer.step() (a "
                "model calling its embedding module twice, or gradient accumulation): under Fabric each lookup's "
                "backward moves the rows, where one process steps once with their summed gradient. Look all ids up "
                "in one call and step after each backward, or train with Trainer(strategy='shardrec') (it sums the "
                "step's lookups)"
            )


ShardRecFabricStrategy.__doc__ = with_strategy_args(ShardRecFabricStrategy.__doc__)
ShardRecFabricStrategy.register_strategies(STRATEGY_REGISTRY)
