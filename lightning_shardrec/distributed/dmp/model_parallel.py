"""``DistributedModelParallel``: plan, shard the embedding collections, DDP the rest.

Plain PyTorch (no Lightning)::

    dist.init_process_group("gloo")
    model = DistributedModelParallel(MyModel(), embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=0.05))
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.05)
    loss = model(batch).mean(); loss.backward(); dense_opt.step()   # tables already stepped in backward
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.configs import FusedOptimConfig
from lightning_shardrec.distributed.comm.collectives import ShardingEnv
from lightning_shardrec.distributed.comm.groups import cached_group
from lightning_shardrec.distributed.comm.qcomm import WirePrecision
from lightning_shardrec.distributed.comm.same_host import attach_transport, use_shm_allreduce
from lightning_shardrec.distributed.dmp import dmp_state
from lightning_shardrec.distributed.dmp.dmp_settings import (
    DataParallelWrapper,
    WaitableDict,
    check_fused,
    env_group,
    fused_only,
    in_backward_tables,
    mark_in_backward,
    materialize_meta,
    resolve_comm_precision,
    resolve_fused_config,
    undecided_tables,
)
from lightning_shardrec.distributed.dmp.shardable import (
    SHARDED,
    ShardedCollection,
    default_device,
    find_collections,
    table_names,
)
from lightning_shardrec.distributed.dmp.sharders import ModuleSharder, check_sharders, get_default_sharders
from lightning_shardrec.distributed.sharded.dynamic_stats import dynamic_stats
from lightning_shardrec.distributed.sharding import KernelSetup
from lightning_shardrec.errors import UnsupportedFeatureError, missing_names
from lightning_shardrec.kernels import KernelBackend
from lightning_shardrec.modules.plain_embeddings import (
    swap_embedding_modules,
)
from lightning_shardrec.optim import FusedOptimizer
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingPlan,
    ShardMetadata,
    Topology,
)


def shard_modules(
    module: nn.Module, plan: ShardingPlan, env: ShardingEnv, setup: KernelSetup
) -> dict[str, ShardedCollection]:
    """Replace each collection in ``module`` (in place) by its sharded version."""
    sharded = {}
    for path, coll in find_collections(module).items():
        tables = plan.get_plan_for_module(path)
        if tables is None:
            raise ValueError(f"the sharding plan has no entry for module '{path or '<root>'}'")
        new = SHARDED[type(coll)](coll, dict(tables), env, setup)  # type: ignore[arg-type]  # keyed by the type it takes
        if path:
            parent, _, leaf = path.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, new)
        sharded[path] = new
    return sharded


def pooling_of(constraints: Mapping[str, ParameterConstraints]) -> dict[str, float]:
    """Table name -> mean ids per bag (the planner's pooling factors), for ``kernel="auto"``'s timing. A
    constraint with the default ``[1.0]`` declares none (it was given for its other fields): such a table's
    kernel is timed over a range of poolings (:data:`~lightning_shardrec.kernels.autotune.UNDECLARED_POOLINGS`)."""
    return {
        name: sum(c.pooling_factors) / len(c.pooling_factors)
        for name, c in constraints.items()
        if list(c.pooling_factors) != [1.0]
    }


def kernel_labels(sharded: Mapping[str, ShardedCollection]) -> dict[tuple[str, str], str]:
    """``(module path, table) -> "fbgemm (1.9x torch)"``: each table's kernel choice, for the plan printout."""
    out: dict[tuple[str, str], list[str]] = {}
    for path, coll in sharded.items():
        for group in coll.groups:
            if group.kernel_choice is None or not group.fused:
                continue
            for t in group.tables:
                labels = out.setdefault((path, t.config.name), [])
                if group.kernel_choice.label() not in labels:
                    labels.append(group.kernel_choice.label())
    return {k: "; ".join(v) for k, v in out.items()}


class DistributedModelParallel(nn.Module):
    """Wraps ``module``: sharded embedding collections, DDP for the dense rest.

    ``plan`` (whole or partial) pins tables; the others are planned by ``planner``
    (default: an :class:`EmbeddingShardingPlanner` for the live process group). Tables
    train inside backward with the optimizer ``apply_optimizer_in_backward`` gave them, else
    their sharder's ``fused_params``, else ``embedding_optimizer`` (default adagrad, lr 0.01;
    :mod:`.dmp_settings`); ``fused_optimizer`` exposes it as a ``torch.optim.Optimizer`` (for LR
    schedulers and checkpoints). TorchRec's positional arguments come first (``env``, ``device``,
    ``plan``, ``sharders``, ``init_data_parallel``, ``init_parameters``, ``data_parallel_wrapper``);
    ``state_dict()`` uses the model's own keys (:mod:`.dmp_state`).

    Plain ``nn.Embedding`` / ``nn.EmbeddingBag`` submodules are sharded too (same call and
    result, see :mod:`lightning_shardrec.modules.plain_embeddings`): ``embedding_modules`` is
    ``True`` (all with at least ``embedding_min_rows`` rows), ``False``, or a list of module paths.

    ``comm_transport``: None (default: ``$LIGHTNING_SHARDREC_TRANSPORT``, else ``"pg"``, the process
    group); ``"auto"`` moves the embeddings' all-to-alls through shared memory when every rank is on
    this host under gloo (:mod:`~lightning_shardrec.distributed.transport.shm`), else through the
    process group; ``"shm"`` requires shared memory, ``"pg"`` never uses it.
    """

    def __init__(
        self,
        module: nn.Module,
        env: Optional[ShardingEnv] = None,
        device: Optional[torch.device] = None,
        plan: Optional[ShardingPlan] = None,
        sharders: Optional[List[ModuleSharder[torch.nn.Module]]] = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: DataParallelWrapper | None = None,
        *,
        planner: EmbeddingShardingPlanner | None = None,
        embedding_optimizer: FusedOptimConfig | str | None = None,
        kernel: KernelBackend | str = KernelBackend.AUTO,
        pg: dist.ProcessGroup | None = None,
        batch_size: int = 512,
        embedding_modules: bool | Sequence[str] = True,
        embedding_min_rows: int = 0,
        comm_precision: str | WirePrecision | None = None,
        comm_transport: str | None = None,
    ) -> None:
        super().__init__()
        if data_parallel_wrapper is not None:
            raise UnsupportedFeatureError(
                f"DistributedModelParallel(data_parallel_wrapper={type(data_parallel_wrapper).__name__}) is not "
                "supported: the dense part is always wrapped in DistributedDataParallel (see docs/migrating.md, "
                "'DistributedModelParallel')"
            )
        if isinstance(env, ShardingPlan | dict):  # this library's former order, (module, plan, ...): still the plan
            if plan is not None:
                raise TypeError("DistributedModelParallel: a plan was given both second and as plan=; pass it once")
            env, plan = None, env
        pg = env_group(env, pg)
        swap_embedding_modules(module, embedding_modules, embedding_min_rows)
        sharders = check_sharders(sharders, "DistributedModelParallel")
        precision = resolve_comm_precision(comm_precision, sharders)
        optim = resolve_fused_config(module, embedding_optimizer, sharders, "DistributedModelParallel")
        in_backward = in_backward_tables(module, sharders)
        undecided = undecided_tables(module, in_backward, embedding_optimizer)
        # ranks per host: the planner's topology when given, so plan and execution see the same hosts
        env = ShardingEnv.from_process_group(pg, planner.topology.local_world_size if planner else 0)  # type: ignore[arg-type]
        self.env = attach_transport(env, comm_transport)  # collective: shared-memory all-to-alls when every rank can
        self.device = torch.device(device) if device is not None else default_device(self.env)
        if planner is None:
            topology = Topology.from_process_group(pg, local_world_size=self.env.local_world_size)
            constraints = fused_only(in_backward, {})
            planner = EmbeddingShardingPlanner(
                topology, batch_size=batch_size, constraints=constraints, optimizer=optim.optimizer
            )
        collections = find_collections(module)
        if isinstance(plan, ShardingPlan) and set(plan.plan) >= set(collections):
            complete = all(set(plan.plan[p]) >= table_names(c) for p, c in collections.items())
        else:
            complete = False
        self.plan = plan if complete else planner.collective_plan(module, pg=pg, fixed=plan)  # type: ignore[arg-type]
        setup = KernelSetup(
            optim=optim,
            backend=kernel,
            device=self.device,
            batch_size=planner.batch_size,
            pooling=pooling_of(planner.constraints),
            comm_precision=precision,
        )
        self.sharded = shard_modules(module, self.plan, self.env, setup)  # type: ignore[arg-type]
        if "" in self.sharded:  # the model *is* a collection
            module = self.sharded[""]
        if init_parameters:
            materialize_meta(module, self.device)
        module.to(self.device)
        self.fused_optimizer = FusedOptimizer([k for s in self.sharded.values() for k in s.kernels()], optim)
        mark_in_backward(self.sharded, self.fused_optimizer)
        check_fused(in_backward, self.sharded, undecided)
        self._dmp_wrapped_module = self._wrap_dense(module) if init_data_parallel else module

    def init_data_parallel(self) -> None:
        """Wrap the dense part in DDP now (after ``init_data_parallel=False``); a no-op when already wrapped."""
        if not isinstance(self._dmp_wrapped_module, DistributedDataParallel) and "" not in self.sharded:
            self._dmp_wrapped_module = self._wrap_dense(self._dmp_wrapped_module)

    def _wrap_dense(self, module: nn.Module) -> nn.Module:
        fused: list[str] = []
        for path, sharded in self.sharded.items():
            for i, group in enumerate(sharded.groups):
                if group.fused:
                    prefix = f"{path}.groups.{i}" if path else f"groups.{i}"
                    fused += [n for n, _ in group.named_parameters(prefix=prefix)]
                    fused += [n for n, _ in group.named_buffers(prefix=prefix)]
        skip = set(fused)
        if not any(p.requires_grad for n, p in module.named_parameters() if n not in skip):
            return module  # nothing dense to synchronise
        compat.ddp_ignore(module, fused)
        device_ids = [self.device] if self.device.type == "cuda" else None
        # DDP's gradient all-reduces fire from backward hooks in an order autograd picks;
        # on their own group they can never interleave with the embeddings' collectives.
        # One per set of ranks, shared by every DMP over them (a group holds threads until destroyed).
        ranks = tuple(dist.get_process_group_ranks(self.env.pg or dist.group.WORLD))
        dense_pg = cached_group(("dense", str(dist.get_backend()), ranks), lambda: dist.new_group(ranks=list(ranks)))
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=dense_pg)
        in_backward = any(hasattr(p, "_in_backward_optimizers") for n, p in module.named_parameters() if n not in skip)
        if self.env.transport is not None and not in_backward:  # DDP's own hook steps in-backward optimizers
            # every rank alike: the dense all-reduce through shared memory too
            use_shm_allreduce(ddp, dense_pg)
        return ddp

    @property
    def module(self) -> nn.Module:
        """The wrapped model (inside DDP when there is a dense part)."""
        m = self._dmp_wrapped_module
        return m.module if isinstance(m, DistributedDataParallel) else m

    def forward(self, *args, **kwargs) -> Any:  # type: ignore[no-untyped-def]
        out = self._dmp_wrapped_module(*args, **kwargs)
        return WaitableDict(out) if type(out) is dict else out  # a sharded EmbeddingCollection's output

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's own names, as TorchRec's (no ``_dmp_wrapped_module.module.`` prefix): optimizer and
        checkpoint keys by name match an unwrapped model's; a data_parallel table is
        ``<collection>.embedding_bags.<table>.weight``. The fused tables are not parameters here."""
        keys = {}
        for path, coll in self.sharded.items():
            for g in coll.groups:
                if not g.fused:  # data_parallel: plain parameters, one per table
                    for t, p in zip(g.tables, getattr(g, "weights", ()), strict=False):
                        keys[id(p)] = (
                            f"{path}.{coll.state_key(t.config.name)}" if path else coll.state_key(t.config.name)
                        )
        dot = f"{prefix}." if prefix else ""
        for name, p in self.module.named_parameters(recurse=recurse, remove_duplicate=remove_duplicate):
            yield dot + keys.get(id(p), name), p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """The model's own names (TorchRec's), as :meth:`named_parameters`."""
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters the user's optimizer should train: all but the fused tables."""
        fused = {id(t) for s in self.sharded.values() for g in s.groups if g.fused for t in g.parameters()}
        fused |= {id(t) for s in self.sharded.values() for g in s.groups if g.fused for t in g.buffers()}
        return (p for p in self.module.parameters() if id(p) not in fused)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's own keys, sharded tables as ShardedTensors (:mod:`.dmp_state`); not collective."""
        if args or destination is not None:
            raise TypeError("DistributedModelParallel.state_dict takes only prefix= and keep_vars=")
        return dmp_state.state_dict(self, prefix, keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load :meth:`state_dict`'s layout, or full tables (a plain model's state dict); not collective."""
        if assign:
            raise UnsupportedFeatureError("DistributedModelParallel.load_state_dict(assign=True) is not supported")
        return dmp_state.load_state_dict(self, state_dict, strict)

    def full_state_dict(self, dst: int | None = None) -> dict[str, Tensor]:
        """Collective: the unsharded model's state dict (every table whole) on rank ``dst`` (None: every rank).

        Tables travel in bands by tensor collectives; ranks other than ``dst`` get ``{}``.
        """
        return dmp_state.full_state_dict(self, dst)

    def dynamic_stats(self, new_window: bool = False) -> dict[str, dict[str, float]]:
        """Collective: per dynamic table, occupancy, capacity, admissions, ..., the window's miss rate and
        suggested capacity, summed over ranks
        (:func:`~lightning_shardrec.distributed.sharded.dynamic_stats.dynamic_stats`); call on every rank."""
        return dynamic_stats(self.module, new_window)

    def local_shards(self) -> dict[str, list[tuple[ShardMetadata, Tensor]]]:
        """``'<module path>.<embedding_bags|embeddings>.<table>.weight' -> [(shard, tensor)]`` held here.

        The unsharded module's keys: ``embedding_bags`` for an EmbeddingBagCollection,
        ``embeddings`` for an EmbeddingCollection.
        """
        out = {}
        for path, s in self.sharded.items():
            prefix = f"{path}." if path else ""
            for table, shards in s.local_shards().items():
                out[f"{prefix}{s.state_key(table)}"] = shards
        return out


def get_module(module: nn.Module) -> nn.Module:
    """``module`` without its ``DistributedModelParallel`` wrappers (a DDP or FSDP wrapper inside is kept)."""
    while isinstance(module, DistributedModelParallel):
        module = module._dmp_wrapped_module
    return module


def get_unwrapped_module(module: nn.Module) -> nn.Module:
    """``module`` without its ``DistributedModelParallel``, DDP and FSDP wrappers (TorchRec's helper)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(module, (DistributedModelParallel, DistributedDataParallel, FullyShardedDataParallel)):
        if isinstance(module, DistributedModelParallel):
            module = module._dmp_wrapped_module
        elif isinstance(module, FullyShardedDataParallel):
            module = module._fsdp_wrapped_module
        else:
            module = module.module
    return module


__getattr__ = missing_names(
    "lightning_shardrec.distributed.model_parallel",  # TorchRec's path of this module
    {
        "DMPCollection": "2D parallelism (shards replicated over groups of ranks) is not supported",
        "HybridEvalDMP": "evaluate with DistributedModelParallel itself (model.eval())",
    },
)

#: TorchRec's module also offers the default sharders here
__all__ = ["DistributedModelParallel", "get_default_sharders", "get_module", "get_unwrapped_module"]
