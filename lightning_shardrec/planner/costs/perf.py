"""Perf half of the cost model: seconds per training step that a shard costs its rank.

For a global batch ``B = batch_size * world_size``, ``P`` ids and ``Q`` bags per sample,
a shard of ``rows x cols`` holding the share ``f = rows / table_rows``:

- table_wise / column_wise (``f = 1``): ids all-to-all in (``B*P*8`` bytes), lookup of
  ``B*P*cols`` elements on the owner, pooled ``[B*Q, cols]`` all-to-all out; backward
  sends the same gradient back and updates the rows (weights + optimizer state).
- row_wise: ids bucketized to row owners (``f`` of them, uniform ids), lookup ``f`` of
  the work, and every owner reduce-scatters a full ``[B*Q, cols]`` partial over all
  ranks (``(W-1)/W`` of it leaves the rank; charged at one NIC per GPU).
- table_row_wise / grid_shard (a grid table's column pieces, each row-blocked inside one
  host): a block costs its ids and lookup as row_wise. The pooled output is reduced among
  the piece's ``k`` holders only (``distributed/comm/hierarchy.py``),
  :func:`holder_output_seconds` per holder: of its ``[B*Q, cols]`` partial, ``(k-1)/k``
  goes to the other holders (intra-host link; each sums its chunk of the sources) and its
  summed ``1/k`` goes to the sources as an all-to-all. Ranks of the host that hold no
  block of the piece pay nothing for it.
- data_parallel: local lookups only; backward all-reduces the whole table gradient
  (``rows*dim*4`` bytes) and the dense optimizer updates the whole table (calibrated: both at
  measured rates, ``allreduce_bw`` and ``dense_bw`` per table byte).

All-to-all bytes are split by destination: ``1/W`` stay on the rank, ``(L-1)/W`` go to
the other ranks of its host (intra-host link), the rest cross hosts (``L`` ranks per host).
Sequence tables (``EmbeddingConfig``) output one row per id instead of one per bag,
so for them every output term scales with ``f``.

Each shard's cost is kept per :class:`Phase` (:func:`shard_phases`; :func:`shard_perf` is their sum,
what the planner balances). With calibrated rates (``Topology(rates=...)``,
:mod:`lightning_shardrec.planner.machine.rates`) each shard's lookup also pays the kernel's fixed
``lookup_seconds``, row_wise's reduce-scatter runs at the measured ``reduce_scatter_bw``, and the plan
records every rank's seconds per phase of each group (:func:`phase_loads`, ``PlanStats.phase_cost``):
the step estimate charges each phase its slowest rank; the fixed step, the calls counted from the plan
and the further groups and pieces are per plan (:func:`~lightning_shardrec.planner.machine.rates.step_estimate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.planner.machine.rates import MECHANISM_CALLS
from lightning_shardrec.planner.machine.topology import Topology
from lightning_shardrec.planner.plans.tables import TableSpec
from lightning_shardrec.planner.plans.types import ShardingType

ID_BYTES = 8  # int64 ids
OUT_BYTES = 4  # fp32 pooled outputs and gradients
STATE_BYTES = 4  # fp32 optimizer state


class Phase(str, Enum):
    """A part of a step between collectives: every rank waits for the slowest in it."""

    INPUT = "input"  # ids all-to-all
    LOOKUP = "lookup"  # kernel forward (and its fixed cost)
    OUTPUT = "output"  # pooled output out, its gradient back (all-to-all, reduce-scatter, in-host exchange)
    UPDATE = "update"  # fused backward update of the rows
    ROWS = "rows"  # the distinct rows the lookup and update miss on (calibrated only; not sped up by idle ranks)
    REPLICATED = "replicated"  # a replicated table's all-reduce and dense update


#: phases where a rank computes (ranks of one machine share its cores there)
COMPUTE_PHASES = frozenset({Phase.LOOKUP, Phase.UPDATE})
Parts = dict[Phase, float]
#: a shard's seconds per step, and the same by phase (they add up to it, up to rounding)
Cost = tuple[float, Parts]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Everything besides the table that the cost model needs."""

    topology: Topology
    batch_size: int
    optimizer: EmbOptimType = EmbOptimType.ADAGRAD

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", EmbOptimType.parse(self.optimizer))
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"Workload: batch_size must be a positive int, got {self.batch_size!r}")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.topology.world_size

    def state_per_row(self, cols: int) -> int:
        return self.optimizer.state_per_row(cols)


def _update_bytes(t: TableSpec, w: Workload, ids: float, cols: int) -> float:
    """Backward: read the gradient, read+write the rows and their optimizer state."""
    per_id = cols * OUT_BYTES + 2 * cols * t.elem_bytes + 2 * w.state_per_row(cols) * STATE_BYTES
    return ids * per_id


def _over(nbytes: float, bandwidth: float) -> float:
    return 0.0 if nbytes == 0 else nbytes / bandwidth


def a2a_seconds(nbytes: float, topo: Topology) -> float:
    """An all-to-all of ``nbytes`` from (or to) one rank, spread evenly over all ranks."""
    world, local = topo.world_size, int(topo.local_world_size)  # type: ignore[arg-type]
    inter = nbytes * (world - local) / world
    intra = nbytes * (local - 1) / world
    return _over(inter, float(topo.inter_host_bw)) + _over(intra, float(topo.intra_host_bw))  # type: ignore[arg-type]


def distinct_rows(ids: float, rows: int) -> float:
    """Expected distinct rows ``ids`` uniform ids touch in a shard of ``rows``: ``rows (1 - e^(-ids/rows))``.

    The planner knows no id distribution; skewed ids touch fewer rows (this is the most)."""
    return 0.0 if rows <= 0 else rows * -math.expm1(-ids / rows)


def _compute(t: TableSpec, w: Workload, ids: float, rows: int, cols: int, comm: float, parts: Parts) -> Cost:
    """``comm`` seconds (``parts`` by phase) and the kernel's: its forward (with the fixed
    ``lookup_seconds``) and update. The total adds up as the planner always has (its ties stay).

    Calibrated, the shard also pays per distinct row it touches (:func:`distinct_rows`): ``row_seconds``
    per row and ``row_byte_seconds`` per byte of its weights and optimizer state. Scattered rows of a
    large table miss the caches, which the per-id bytes at ``memory_bw`` (rows in cache) do not show; a
    column piece misses on its own rows. Every rank pays its rows at the shared rate (:attr:`Phase.ROWS`)."""
    rates = w.topology.rates
    fixed = 0.0 if rates is None else rates.lookup_seconds
    bw = w.topology.memory_bw
    lookup, update = ids * cols * t.elem_bytes, _update_bytes(t, w, ids, cols)
    scattered = 0.0
    if rates is not None and (rates.row_seconds or rates.row_byte_seconds):
        row = cols * t.elem_bytes + w.state_per_row(cols) * STATE_BYTES
        scattered = distinct_rows(ids, rows) * (rates.row_seconds + row * rates.row_byte_seconds)
    total = comm + (fixed + (lookup + update) / bw + scattered)
    out = parts | {Phase.LOOKUP: fixed + lookup / bw, Phase.UPDATE: update / bw}
    return total, out | ({Phase.ROWS: scattered} if scattered else {})


def _table_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> Cost:
    frac = rows / t.rows
    ids = w.global_batch * t.ids_per_sample * frac
    out_rows = ids if t.sequence else w.global_batch * t.bags_per_sample * frac
    inp, out = ids * ID_BYTES, 2 * out_rows * cols * OUT_BYTES
    parts = {Phase.INPUT: a2a_seconds(inp, w.topology), Phase.OUTPUT: a2a_seconds(out, w.topology)}
    return _compute(t, w, ids, rows, cols, a2a_seconds(inp + out, w.topology), parts)


def _row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> Cost:
    if t.sequence:  # every id to one owner, its row straight back: an all-to-all
        return _table_wise(t, w, rows, cols)
    topo = w.topology
    frac = rows / t.rows
    ids = w.global_batch * t.ids_per_sample * frac
    partial = w.global_batch * t.bags_per_sample * cols * OUT_BYTES
    scatter = 2 * partial * (topo.world_size - 1) / topo.world_size
    bw = topo.comm_bw if topo.rates is None else topo.rates.reduce_scatter_bw
    inp, out = a2a_seconds(ids * ID_BYTES, topo), _over(scatter, bw)
    return _compute(t, w, ids, rows, cols, inp + out, {Phase.INPUT: inp, Phase.OUTPUT: out})


def _table_row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> Cost:
    """A block's ids and lookup; its output is :func:`holder_output_seconds`, charged per holder."""
    if t.sequence:
        return _table_wise(t, w, rows, cols)
    ids = w.global_batch * t.ids_per_sample * rows / t.rows
    inp = a2a_seconds(ids * ID_BYTES, w.topology)
    return _compute(t, w, ids, rows, cols, inp, {Phase.INPUT: inp})


def _chunk_sources(world: int, holders: int, index: int) -> range:
    """The sources whose sums holder ``index`` of ``holders`` sends home: ``s * k // W == index``."""
    return range(-(-index * world // holders), -(-(index + 1) * world // holders))


def holder_output_seconds(
    t: TableSpec, w: Workload, cols: int, holders: int, rank: int | None = None, index: int | None = None
) -> float:
    """What a pooled table_row_wise table or grid piece ``cols`` wide costs each of its ``holders`` (k).

    Of the holder's ``[B*Q, cols]`` partial (``P`` bytes): ``2 (k-1)/k P`` over the intra-host
    link (step 1 and its backward), then step 2 and the gradient back: every source of the holder's
    chunk (``distributed/comm/hierarchy.py``: source ``s`` to holder ``s * k // W``, contiguous ranks)
    gets its ``[B, cols]`` sums, over the intra-host link when it is on the holder's host, over the
    network when not, nothing for the holder itself. ``rank`` and ``index`` (the holder's position
    among the piece's holders, by rank) say which chunk; without them, the dearest a holder's chunk
    can be (as many of its sources as there can be on other hosts), which the fill sizes blocks with.
    Sequence tables: 0 (their rows go straight back, costed per shard).
    """
    if t.sequence:
        return 0.0
    topo = w.topology
    world, local = topo.world_size, int(topo.local_world_size)  # type: ignore[arg-type]
    partial = w.global_batch * t.bags_per_sample * cols * OUT_BYTES
    per_source = 2 * partial / world
    inside = 2 * partial * (holders - 1) / holders
    if rank is None or index is None:
        sources = len(_chunk_sources(world, holders, 0))
        away = min(sources, world - local)
        near = sources - away
    else:
        chunk = _chunk_sources(world, holders, index)
        host = topo.host_ranks(topo.host_of(rank))
        same = max(0, min(chunk.stop, host.stop) - max(chunk.start, host.start))
        away = len(chunk) - same
        near = same - (1 if rank in chunk else 0)
    return _over(inside + near * per_source, float(topo.intra_host_bw)) + _over(  # type: ignore[arg-type]
        away * per_source, float(topo.inter_host_bw)  # type: ignore[arg-type]
    )


def host_charges(t: TableSpec, w: Workload, kind: ShardingType, shards: list[tuple[int, int, int]]) -> dict[int, float]:
    """Per rank, the :func:`holder_output_seconds` of a table's shards ``(rank, col0, cols)``.

    A piece's holders on one host each pay once for it, ``k`` = how many ranks of that host
    hold its blocks (table_row_wise and grid_shard; other types: none), each for its own chunk.
    """
    if kind not in HOST_OUTPUT:
        return {}
    topo = w.topology
    pieces: dict[tuple[int, int, int], set[int]] = {}
    for r, c0, cols in shards:
        pieces.setdefault((topo.host_of(r), c0, cols), set()).add(r)
    out: dict[int, float] = {}
    for (_, _, cols), holders in sorted(pieces.items()):
        for i, r in enumerate(sorted(holders)):
            out[r] = out.get(r, 0.0) + holder_output_seconds(t, w, cols, len(holders), r, i)
    return out


def _data_parallel(t: TableSpec, w: Workload, rows: int, cols: int) -> Cost:
    topo = w.topology
    ids = w.batch_size * t.ids_per_sample
    lookup = ids * cols * t.elem_bytes + ids * cols * OUT_BYTES
    world = topo.world_size
    allreduce = 2 * (world - 1) / world * rows * cols * OUT_BYTES
    dense_update = rows * (2 * cols * t.elem_bytes + 2 * w.state_per_row(cols) * STATE_BYTES)
    if topo.rates is None:
        total = allreduce / topo.comm_bw + (lookup + dense_update) / topo.memory_bw
        replicated = allreduce / topo.comm_bw + dense_update / topo.memory_bw
        return total, {Phase.LOOKUP: lookup / topo.memory_bw, Phase.REPLICATED: replicated}
    rates = topo.rates  # measured: the all-reduce, and the dense gradient + optimizer step per table byte
    table = rows * cols * t.elem_bytes
    parts = {
        Phase.LOOKUP: rates.lookup_seconds + lookup / topo.memory_bw,
        Phase.REPLICATED: allreduce / rates.allreduce_bw + table / rates.dense_bw,
    }
    return parts[Phase.LOOKUP] + parts[Phase.REPLICATED], parts


PERF: dict[ShardingType, Callable[[TableSpec, Workload, int, int], Cost]] = {
    ShardingType.TABLE_WISE: _table_wise,
    ShardingType.COLUMN_WISE: _table_wise,
    ShardingType.ROW_WISE: _row_wise,
    ShardingType.TABLE_ROW_WISE: _table_row_wise,
    ShardingType.GRID_SHARD: _table_row_wise,
    ShardingType.DATA_PARALLEL: _data_parallel,
}


#: sharding types whose pooled output is charged per holder (:func:`host_charges`)
HOST_OUTPUT = frozenset({ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD})


def shard_phases(table: TableSpec, work: Workload, kind: ShardingType, rows: int, cols: int) -> Parts:
    """Seconds per step a ``rows x cols`` shard of ``table`` costs its rank, per :class:`Phase`."""
    return PERF[kind](table, work, rows, cols)[1]


def shard_perf(table: TableSpec, work: Workload, kind: ShardingType, rows: int, cols: int) -> float:
    """Seconds per step a ``rows x cols`` shard of ``table`` costs its rank (plus :func:`host_charges`)."""
    return PERF[kind](table, work, rows, cols)[0]


#: a sharding type's group (its mechanism, ``rates.MECHANISM_CALLS``): each group has its own collectives
GROUP_OF = {kind: "+".join(sorted(types)) for types in MECHANISM_CALLS for kind in types}


def phase_loads(
    placed: Iterable[tuple[TableSpec, ShardingType, list[tuple[int, int, int, int]]]], work: Workload
) -> dict[str, tuple[float, ...]]:
    """Per phase of each group (``"output/row_wise"``), every rank's seconds in it.

    ``placed``: per table, its sharding type and shards ``(rank, col0, rows, cols)``. The slowest rank
    of each phase sets the step (:func:`~lightning_shardrec.planner.machine.rates.critical_path`).
    """
    out: dict[str, list[float]] = {}
    world = work.topology.world_size

    def add(phase: Phase, kind: ShardingType, rank: int, seconds: float) -> None:
        out.setdefault(f"{phase.value}/{GROUP_OF[kind.value]}", [0.0] * world)[rank] += seconds

    for spec, kind, shards in placed:
        for rank, _, rows, cols in shards:
            for phase, seconds in shard_phases(spec, work, kind, rows, cols).items():
                add(phase, kind, rank, seconds)
        owners = [(r, c0, cols) for r, c0, _, cols in shards]
        for rank, seconds in host_charges(spec, work, kind, owners).items():
            add(Phase.OUTPUT, kind, rank, seconds)
    return {key: tuple(v) for key, v in sorted(out.items())}
