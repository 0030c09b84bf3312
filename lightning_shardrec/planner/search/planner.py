"""``EmbeddingShardingPlanner``: tables + topology + constraints -> ``ShardingPlan``.

Pure: plans for a pretend world, touches no process group (see ``collective`` for the
few lines that share a plan across ranks; without a ``topology`` the default reads the
live group's size). Stages: find tables -> resolve constraints
-> user-given shardings -> data-parallel tables -> partition the rest -> plan.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.errors import PlannerError, UnsupportedFeatureError
from lightning_shardrec.planner.costs.dynamic_plan import dynamic_layouts
from lightning_shardrec.planner.costs.perf import Workload, host_charges, phase_loads, shard_perf
from lightning_shardrec.planner.costs.storage import resident_bytes, shard_storage
from lightning_shardrec.planner.machine.memory import DEFAULT_RESERVE, RESERVED_FOR, MemoryBudget, check_reserve
from lightning_shardrec.planner.machine.rates import step_estimate
from lightning_shardrec.planner.machine.reservations import check_reservation, reserved_fraction
from lightning_shardrec.planner.machine.topology import ComputeDevice, Topology
from lightning_shardrec.planner.plans.sharding_plan import FixedPlan, GiB, PlanStats, ShardingPlan
from lightning_shardrec.planner.plans.table_params import with_constraint_fields
from lightning_shardrec.planner.plans.tables import (
    TablesInput,
    TableSpec,
    find_tables,
    in_backward_constraints,
    table_specs,
)
from lightning_shardrec.planner.plans.types import (
    ParameterConstraints,
    ParameterSharding,
    ShardingType,
)
from lightning_shardrec.planner.plans.validate import sharding_problems
from lightning_shardrec.planner.search.collective import collective_plan
from lightning_shardrec.planner.search.enumerate import (
    TableOptions,
    next_to_shard,
    prefers_data_parallel,
    table_options,
)
from lightning_shardrec.planner.search.partition import (
    Placement,
    RankLoads,
    as_sharding,
    data_parallel_sharding,
    makespan,
    partition,
    placed_shards,
)

Key = tuple[str, str]
DEFAULT_BATCH_SIZE = 512  # per rank, TorchRec's default
log = logging.getLogger(__name__)


def default_topology() -> Topology:
    """TorchRec's default: the live process group (device from its backend), else one rank here."""
    if dist.is_available() and dist.is_initialized():
        return Topology.from_process_group()
    return Topology(1, compute_device=ComputeDevice.CUDA if torch.cuda.is_available() else ComputeDevice.CPU)


def _check_sharders(sharders: object) -> None:
    if sharders is None or (isinstance(sharders, Sequence) and not isinstance(sharders, str)):
        return
    hint = (
        "; a pinned plan now goes by keyword: plan(module, fixed=...)"
        if isinstance(sharders, (ShardingPlan, Mapping))
        else ""
    )
    raise TypeError(
        f"EmbeddingShardingPlanner: sharders must be a list of module sharders or None, "
        f"got {type(sharders).__name__}{hint}"
    )


class EmbeddingShardingPlanner:
    """Plans how to shard embedding tables over ``topology`` (``batch_size`` is per rank).

    TorchRec's constructor order. ``topology`` defaults to the live process group
    (:meth:`Topology.from_process_group`), or one rank without one; ``batch_size`` to 512.
    This planner enumerates, partitions and rates plans itself: ``enumerator``,
    ``proposer``, ``partitioner``, ``performance_model`` and ``stats`` (and TorchRec's later
    ``callbacks``, ``plan_loader``) raise :class:`UnsupportedFeatureError` unless None (steer it
    with ``constraints`` or pin tables with ``plan(module, fixed=...)``). ``storage_reservation``
    (TorchRec's :class:`~lightning_shardrec.planner.machine.reservations.StorageReservation`) takes
    the place of ``reserve``: each plan fills the topology its ``reserve(...)`` leaves.
    ``debug`` logs each plan at INFO on this module's logger; ``timeout_seconds`` is accepted
    and unused (this planner runs one greedy pass, not a timed search). ``optimizer`` and
    ``reserve`` (ours, keyword-only) size the optimizer state the memory model charges and the
    memory it keeps free.

    ``reserve`` (default 0.15) is the fraction of each rank's memory kept free for what the
    planner cannot see (dense model, activations, communication buffers, CUDA context,
    allocator slack; see :mod:`~lightning_shardrec.planner.machine.memory`): tables, their optimizer
    state and buffers get ``memory_cap * (1 - reserve)`` per rank.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator: object | None = None,
        storage_reservation: object | None = None,
        proposer: object | None = None,
        partitioner: object | None = None,
        performance_model: object | None = None,
        stats: object | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        debug: bool = True,
        callbacks: list[object] | None = None,
        timeout_seconds: int | None = None,
        plan_loader: object | None = None,
        *,
        optimizer: EmbOptimType | str = EmbOptimType.ADAGRAD,
        reserve: float | None = None,
    ) -> None:
        given = {
            "enumerator": enumerator,
            "proposer": proposer,
            "partitioner": partitioner,
            "performance_model": performance_model,
            "stats": stats,
            "callbacks": callbacks or None,
            "plan_loader": plan_loader,
        }
        for name, value in given.items():
            if value is not None:
                raise UnsupportedFeatureError(
                    f"EmbeddingShardingPlanner: {name}={type(value).__name__} is not supported (this planner "
                    "enumerates, partitions and rates plans itself); leave it None and steer the plan with "
                    "constraints={table: ParameterConstraints(...)} or pin tables with plan(module, fixed=...). "
                    "See docs/migrating.md"
                )
        if timeout_seconds is not None and (not isinstance(timeout_seconds, int) or timeout_seconds <= 0):
            raise ValueError(
                f"EmbeddingShardingPlanner: timeout_seconds must be a positive int or None, got {timeout_seconds!r}"
            )
        if batch_size is None:
            batch_size = DEFAULT_BATCH_SIZE
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"EmbeddingShardingPlanner: batch_size must be a positive int, got {batch_size!r}")
        if topology is None:
            topology = default_topology()
        if not isinstance(topology, Topology):
            raise TypeError(
                f"EmbeddingShardingPlanner: topology must be a Topology (or None for the live process "
                f"group), got {type(topology).__name__}"
            )
        self.topology = topology
        self.batch_size = batch_size
        self.constraints = dict(constraints or {})
        self.storage_reservation = check_reservation(storage_reservation, reserve, "EmbeddingShardingPlanner")
        reserve = DEFAULT_RESERVE if reserve is None else reserve
        self.reserve = check_reserve(reserve, "EmbeddingShardingPlanner: reserve")
        self.budget = MemoryBudget(topology.memory_cap, self.reserve)
        self.debug = bool(debug)
        self.work = Workload(topology=topology, batch_size=batch_size, optimizer=EmbOptimType.parse(optimizer))

    def collective_plan(
        self,
        module: TablesInput,
        sharders: Sequence[object] | None = None,
        pg: Any = None,
        *,
        fixed: FixedPlan | None = None,
    ) -> ShardingPlan:
        """:meth:`plan` on rank 0, broadcast to every rank of ``pg`` (default: the world).

        Without an initialized process group this is just :meth:`plan`.
        """
        _check_sharders(sharders)
        return collective_plan(self, module, fixed, pg=pg)

    def plan(
        self,
        module: TablesInput,
        sharders: Sequence[object] | None = None,
        *,
        fixed: FixedPlan | None = None,
    ) -> ShardingPlan:
        """Plan every table of ``module`` (or of a dict module path -> table configs).

        ``sharders`` (TorchRec's list of module sharders) is accepted and not needed:
        every embedding collection of ``module`` is planned. ``fixed`` (a whole or
        partial plan, or table name -> sharding) is kept as given after validation; the
        planner places the other tables around it.
        """
        _check_sharders(sharders)
        plan = self._plan(module, fixed)
        if self.debug:
            log.info("EmbeddingShardingPlanner plan for %d rank(s):\n%s", self.topology.world_size, plan)
        return plan

    def _plan(self, module: TablesInput, fixed: FixedPlan | None) -> ShardingPlan:
        topo = self.topology
        if self.storage_reservation is not None:  # what it leaves depends on the module
            self.reserve = reserved_fraction(self.storage_reservation, topo, self.batch_size, module, self.constraints)
            self.budget = MemoryBudget(topo.memory_cap, self.reserve)
        constraints = in_backward_constraints(module, self.constraints)
        specs = table_specs(find_tables(module), constraints, topo.world_size)
        given = self._fixed(fixed, specs)
        opts = [self._options(spec) for spec in specs if spec.key not in given]
        plan = self._place(specs, given, opts, auto_dp=True)
        cap = self.budget.tables
        if topo.rates is None:
            nearest = next_to_shard(opts, cap, topo.world_size)
            if nearest is None:
                return plan
            try:  # one more table sharded: kept where its slowest rank is cheaper
                other = self._place(specs, given, opts, auto_dp=True, keep_sharded=nearest.table.key)
            except PlannerError:
                return plan
            return other if _slowest(other) < _slowest(plan) else plan
        if not any(prefers_data_parallel(o, cap) and len(o.kinds) > 1 for o in opts):
            return plan
        # measured rates: replicating a small table adds a group, which its own cost does not show
        try:
            sharded = self._place(specs, given, opts, auto_dp=False)
        except PlannerError:
            return plan
        return sharded if step_estimate(sharded, topo) < step_estimate(plan, topo) else plan

    def _options(self, spec: TableSpec) -> TableOptions:
        opt = table_options(spec, self.work)
        if not opt.kinds:
            grid = (
                f"; grid_shard needs at least 2 x min_partition columns (the table has {spec.dim}, "
                f"min_partition {spec.min_partition})"
                if ShardingType.GRID_SHARD in spec.sharding_types
                else ""
            )
            raise PlannerError(
                f"table {spec.label}: no sharding type fits its constraints (sharding_types "
                f"{[k.value for k in spec.sharding_types]}, compute_kernels "
                f"{[k.value for k in spec.compute_kernels]}, ranks {spec.ranks}); data_parallel "
                f"needs the 'dense' kernel and every rank, the others need 'fused'{grid}"
            )
        return opt

    def _place(
        self,
        specs: list[TableSpec],
        given: dict[Key, ParameterSharding],
        opts: list[TableOptions],
        auto_dp: bool,
        keep_sharded: Key | None = None,
    ) -> ShardingPlan:
        """The plan: ``given`` tables as given, small tables replicated (``auto_dp``: where cheaper in
        total, except ``keep_sharded``; else only those that must be), the rest partitioned."""
        topo, work = self.topology, self.work
        by_key = {s.key: s for s in specs}
        cap = self.budget.tables
        load = [0.0] * topo.world_size
        used = [0] * topo.world_size
        result: dict[Key, ParameterSharding] = {}
        owners: dict[int, list[str]] = {}
        for key, ps in given.items():
            self._charge(by_key[key], ps, load, used, owners)
            result[key] = ps
        lower = sum(load)
        for opt in opts:
            lower += opt.cheapest_total
        lower /= topo.world_size
        free_opts: list[TableOptions] = []
        for opt in opts:
            only = all(k is ShardingType.DATA_PARALLEL for k in opt.kinds)
            if prefers_data_parallel(opt, cap) and ((auto_dp and opt.table.key != keep_sharded) or only):
                ps = data_parallel_sharding(opt.table, topo.world_size)
                self._charge(opt.table, ps, load, used, owners)
                result[opt.table.key] = ps
            else:
                free_opts.append(opt)
        over = [r for r in range(topo.world_size) if used[r] > cap]
        if over:
            raise PlannerError(
                "the given and data-parallel tables do not fit in memory:\n  "
                + "\n  ".join(
                    f"rank {r} needs {used[r]} bytes ({used[r] / GiB:.2f} GiB) for tables "
                    f"{sorted(set(owners[r]))}; {cap} bytes ({cap / GiB:.2f} GiB) allowed"
                    for r in over
                )
                + f"\n  per rank: {self._budget_text()}"
            )
        free = [cap - u for u in used]

        def build(placed: list[Placement], ranks: RankLoads) -> ShardingPlan:
            return self._build(specs, result | {p.table.key: as_sharding(p) for p in placed}, ranks, lower)

        def estimate(placed: list[Placement], ranks: RankLoads) -> float:
            return step_estimate(build(placed, ranks), topo)

        placed, failed, ranks = partition(
            free_opts, work, load, free, lower, makespan if topo.rates is None else estimate
        )
        if failed:
            full = min(range(topo.world_size), key=lambda r: (ranks.free[r], r))
            held = int(cap - ranks.free[full])
            names = sorted(o.table.name for o in failed)
            raise PlannerError(
                "no sharding plan fits in memory:\n  "
                + "\n  ".join(self._too_big(o, ranks) for o in failed)
                + f"\n  per rank: {self._budget_text()}"
                + f"\n  fullest rank {full}: {held} bytes ({held / GiB:.2f} GiB) of tables, optimizer state and "
                f"buffers placed before {names} fit nowhere; capacity {topo.memory_cap} bytes "
                f"({topo.memory_cap / GiB:.2f} GiB)"
            )
        return build(placed, ranks)

    def _build(
        self, specs: list[TableSpec], result: dict[Key, ParameterSharding], ranks: RankLoads, lower: float
    ) -> ShardingPlan:
        """The plan of ``result`` (every table's sharding) with its stats."""
        topo = self.topology
        plan: dict[str, dict[str, ParameterSharding]] = {}
        for spec in specs:
            ps = with_constraint_fields(result[spec.key], self.constraints.get(spec.name))
            plan.setdefault(spec.path, {})[spec.name] = ps
        stats = PlanStats(
            rank_storage=[self.budget.tables - f for f in ranks.free],  # bytes the tables use
            rank_cost=ranks.load,
            storage_cap=topo.memory_cap,
            lower_bound=lower,
            reserve=self.reserve,
            phase_cost={} if topo.rates is None else phase_loads(placed_shards(specs, result), self.work),
        )
        device, local = str(topo.compute_device.value), topo.local_world_size or 1
        dynamic = dynamic_layouts(specs, self.work)
        return ShardingPlan(plan, stats=stats, dynamic=dynamic, compute_device=device, local_world_size=local)

    def _fixed(self, fixed: FixedPlan | None, specs: list[TableSpec]) -> dict[Key, ParameterSharding]:
        if fixed is None:
            return {}
        by_key = {s.key: s for s in specs}
        available = ", ".join(f"{p or '<root>'}.{n}" for p, n in sorted(by_key))
        problems: list[str] = []
        if isinstance(fixed, ShardingPlan):
            wanted = {(p, n): ps for p, tables in fixed.plan.items() for n, ps in tables.items()}
        else:
            wanted = {(s.path, s.name): fixed[s.name] for s in specs if s.name in fixed}
            known = {s.name for s in specs}
            problems.extend(
                f"table '{n}' is not in the model; available: {available}" for n in sorted(set(fixed) - known)
            )
        for key, ps in sorted(wanted.items()):
            spec = by_key.get(key)
            if spec is None:
                problems.append(f"table '{key[1]}' (module '{key[0]}') is not in the model; available: {available}")
                continue
            if not isinstance(ps, ParameterSharding):
                problems.append(f"table {spec.label}: expected a ParameterSharding, got {type(ps).__name__}")
                continue
            problems.extend(f"table {spec.label}: {p}" for p in sharding_problems(spec, ps, self.topology))
        if problems:
            raise PlannerError("invalid given sharding plan:\n  " + "\n  ".join(problems))
        return wanted

    def _charge(
        self,
        spec: TableSpec,
        ps: ParameterSharding,
        load: list[float],
        used: list[int],
        owners: dict[int, list[str]],
    ) -> None:
        costs: dict[tuple[int, int], tuple[float, int]] = {}  # shard size -> (seconds, bytes)
        for s in ps.shards:
            rows, cols = s.shard_sizes
            if (rows, cols) not in costs:
                costs[(rows, cols)] = (
                    shard_perf(spec, self.work, ps.sharding_type, rows, cols),
                    shard_storage(spec, self.work, ps.sharding_type, rows, cols),
                )
            seconds, nbytes = costs[(rows, cols)]
            load[s.rank] += seconds
            used[s.rank] += nbytes
            owners.setdefault(s.rank, []).append(spec.name)
        shards = [(s.rank, s.shard_offsets[1], s.shard_sizes[1]) for s in ps.shards]
        for rank, seconds in host_charges(spec, self.work, ps.sharding_type, shards).items():
            load[rank] += seconds

    def _too_big(self, opt: TableOptions, ranks: RankLoads) -> str:
        spec = opt.table
        weights, state = resident_bytes(spec, self.work)
        buffers = opt.tw_mem - weights - state
        best = max(range(len(ranks.free)), key=lambda r: (ranks.free[r], -r))
        largest = int(ranks.free[best])
        total = int(sum(max(f, 0) for f in ranks.free))
        return (
            f"table {spec.label} needs {opt.tw_mem} bytes ({opt.tw_mem / GiB:.2f} GiB: weights "
            f"{weights / GiB:.2f} + optimizer state {state / GiB:.2f} + buffers {buffers / GiB:.2f}) "
            f"with sharding types {[k.value for k in opt.kinds]}; largest free capacity {largest} bytes "
            f"({largest / GiB:.2f} GiB, rank {best}), "
            f"{total} bytes ({total / GiB:.2f} GiB) free over {len(ranks.free)} ranks"
        )

    def _budget_text(self) -> str:
        if self.storage_reservation is not None:
            return f"{self.budget.describe()}; the reserve is {type(self.storage_reservation).__name__}'s"
        return (
            f"{self.budget.describe()}; the reserve is kept for {RESERVED_FOR} "
            "(lower it with reserve=, or --reserve in plan on paper)"
        )


def _slowest(plan: ShardingPlan) -> float:
    return max(plan.stats.rank_cost) if plan.stats is not None else float("inf")
