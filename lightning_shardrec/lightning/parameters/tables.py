"""``ShardedTables``: the planner step and the model sharding, one plain object under both strategies.

It holds what sharding a model produced (the sharded collections by module path, the plan,
the topology the planner assumed, the fused optimizer and its rule) and does the steps both
:class:`~lightning_shardrec.lightning.ShardRecStrategy` (Trainer) and
:class:`~lightning_shardrec.lightning.strategies.fabric.ShardRecFabricStrategy` (Fabric) take: find the
tables, plan and shard them (collective), build the fused optimizer with its lr linked to the
param group the tables came from, and read the dense and full state (the dense rest:
:mod:`lightning_shardrec.lightning.parameters.dense`). It needs an initialized process group and nothing of Lightning::

    tables = ShardedTables(ShardRecOptions(kernel="torch"))
    tables.shard(model, tables.options.fused_config(None, None), torch.device("cpu"), local_world_size=1)
    tables.link(None)  # the fused optimizer, lr as configured
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_shardrec.checkpoint import gather_full_state, param_layout, table_parameter_keys
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.same_host import attach_transport
from lightning_shardrec.distributed.dmp.dmp_settings import check_fused, in_backward_tables, undecided_tables
from lightning_shardrec.distributed.dmp.model_parallel import find_collections, kernel_labels, shard_modules
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.kernels import KernelBackend
from lightning_shardrec.lightning.parameters.optimizers import (
    Holder,
    add_params,
    find_group,
    group_at,
    group_slot,
    remove_params,
)
from lightning_shardrec.lightning.reports.plan_report import print_plan, print_transport
from lightning_shardrec.lightning.strategies.options import ShardRecOptions
from lightning_shardrec.modules.plain_embeddings import swap_embedding_modules
from lightning_shardrec.optim import FusedOptimizer
from lightning_shardrec.planner import ShardingPlan, Topology
from lightning_shardrec.planner.machine.mesh import host_mesh, mesh_layout


class ShardedTables:
    """A model's sharded embedding collections, their plan and their fused optimizer (see the module doc)."""

    def __init__(self, options: ShardRecOptions) -> None:
        self.options = options
        self.sharded: dict[str, ShardedCollection] = {}
        self.plan: ShardingPlan | None = None
        self.topology: Topology | None = None  # what the planner assumed (hosts from num_nodes x devices)
        self.fused_optimizer: FusedOptimizer | None = None
        self.config: FusedOptimConfig | None = None  # the tables' fused rule
        self.migrated: FusedOptimConfig | None = None  # set by apply_optimizer_in_backward / sharders
        self.holder_slot: tuple[int, int] | None = None  # the param group the tables train as, across fits

    # --- planner step and sharding ------------------------------------------------------------
    def find(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The collections still to shard (plain embedding modules swapped in place first); adopts the
        collections an earlier strategy sharded when there are none."""
        swap_embedding_modules(module, self.options.embedding_modules, self.options.embedding_min_rows)
        collections = find_collections(module)
        if not collections and not self.sharded:
            self.adopt(module)
        return collections

    def adopt(self, module: torch.nn.Module) -> None:
        """Take over the collections another strategy sharded (a second Trainer on the same model)."""
        self.sharded = {n: m for n, m in module.named_modules() if isinstance(m, ShardedCollection)}
        origin = getattr(next(iter(self.sharded.values()), None), "shardrec_origin", None)
        if origin is not None:
            self.plan, self.holder_slot, self.config = origin

    def shard(
        self,
        module: torch.nn.Module,
        config: FusedOptimConfig,
        device: torch.device,
        local_world_size: int,
        deferred: bool = False,
    ) -> None:
        """Collective: plan ``module``'s collections for the process group's world and shard them in place."""
        self.config = config
        fused_tables = in_backward_tables(module, self.options.sharders)  # TorchRec's optimizer settings: fused
        undecided = undecided_tables(module, fused_tables, self.options.embedding_optimizer)
        mesh = host_mesh(local_world_size)  # collective the first time: (hosts, local) from Lightning's numbers
        env = ShardingEnv.from_process_group(local_world_size=mesh_layout(mesh)[1])
        env = attach_transport(env, self.options.comm_transport)  # collective; waits as long as the group's timeout
        self.topology = Topology.from_device_mesh(mesh, compute_device=device.type)
        planner = self.options.planner(self.topology, fused_tables, config)
        self.plan = planner.collective_plan(module, fixed=self.options.plan)  # type: ignore[arg-type]
        setup = self.options.kernel_setup(config, device, deferred=deferred)
        self.sharded = shard_modules(module, self.plan, env, setup)
        check_fused(fused_tables, self.sharded, undecided)
        print_plan(self.plan, kernel_labels(self.sharded), None)
        print_transport(env)  # collective

    def renew(self, config: FusedOptimConfig) -> None:
        """Collections sharded before, a new fit: this fit's rule, a fresh fused state."""
        self.config = config
        self.fused_optimizer = None
        for coll in self.sharded.values():
            coll.rebuild_kernels(config)

    def pick_holder(self, optimizers: list[torch.optim.Optimizer], table_params: list[Any]) -> Holder | None:
        """The (optimizer, param group) the tables train as: the one holding them, else (a later fit: the
        tables are in no group) the one they trained as before; remembered for the next fit."""
        holder = find_group(optimizers, table_params) or group_at(optimizers, self.holder_slot)
        self.holder_slot = group_slot(optimizers, holder)
        return holder

    def kernels(self) -> list[Any]:
        return [k for s in self.sharded.values() for k in s.kernels()]

    def link(self, holder: Holder | None) -> list[Any]:
        """The fused optimizer (lr linked to the holder's param group, read live: survives a resume) and the
        origin a later strategy adopts; the kernels of every table group."""
        kernels = self.kernels()
        if self.fused_optimizer is None:
            assert self.config is not None
            self.fused_optimizer = FusedOptimizer(kernels, self.config)
        if holder is not None:
            self.fused_optimizer.link_lr(holder[0], [id(g) for g in holder[0].param_groups].index(id(holder[1])))
        for coll in self.sharded.values():  # for a later strategy on the same model (see adopt)
            coll.shardrec_origin = (self.plan, self.holder_slot, self.config)  # type: ignore[assignment]
        return kernels

    def clip_rows(self, clip: float | None) -> None:
        """Torch kernels for every table group (they clamp rows; fbgemm's TBE cannot), clamping at ``clip``."""
        assert self.config is not None
        for coll in self.sharded.values():
            if any(k.backend is not KernelBackend.TORCH for k in coll.kernels()):
                coll.rebuild_kernels(self.config, KernelBackend.TORCH)
                self.fused_optimizer = None
        for k in self.kernels():
            k.grad_clip_value = clip

    def table_groups(self, fused: bool) -> list[Any]:
        return [g for s in self.sharded.values() for g in s.groups if g.fused == fused]

    def hand_over(
        self,
        optimizers: list[torch.optim.Optimizer],
        collections: Mapping[str, torch.nn.Module],
        table_params: list[torch.nn.Parameter],
        holder: Holder | None,
    ) -> list[list[list[torch.nn.Parameter | str]]]:
        """The fused tables leave the user's ``optimizers`` (data-parallel tables join the holder's group);
        returns the param groups as the user built them (tables as keys: no full weight kept), with which
        a checkpoint written without the strategy resumes."""
        keys = {**dict.fromkeys(map(id, table_params), ""), **table_parameter_keys(collections, self.sharded)}
        before = param_layout(optimizers, keys)
        remove_params(optimizers, table_params)
        dense_tables = [p for g in self.table_groups(fused=False) for p in g.parameters()]
        held = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
        dense_tables = [p for p in dense_tables if id(p) not in held]
        if dense_tables and holder is not None:
            add_params(holder, dense_tables)  # data-parallel tables train like dense layers
        return before

    # --- state --------------------------------------------------------------------------------
    def dense_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (a module's state dict) without the sharded tables' entries."""
        prefixes = tuple(f"{p}." for p in self.sharded)
        return {k: v for k, v in state.items() if not k.startswith(prefixes)}

    def full_state(self, dense: Mapping[str, Any], rank: int, dst: int | None = None) -> dict[str, torch.Tensor]:
        """Collective: ``dense`` and the tables gathered on global rank ``dst`` (``None``: every rank);
        ``{}`` on the other ranks."""
        weights, _ = gather_full_state(self.sharded, dst)
        if dst is not None and rank != dst:
            return {}
        return {**dense, **weights}
