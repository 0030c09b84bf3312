"""Perf half of the cost model: seconds per training step that a shard costs its rank.

For a global batch ``B = batch_size * world_size``, ``P`` ids and ``Q`` bags per sample,
a shard of ``rows x cols`` holding the share ``f = rows / table_rows``:

- table_wise / column_wise (``f = 1``): ids all-to-all in (``B*P*8`` bytes), lookup of
  ``B*P*cols`` elements on the owner, pooled ``[B*Q, cols]`` all-to-all out; backward
  sends the same gradient back and updates the rows (weights + optimizer state).
- row_wise: ids bucketized to row owners (``f`` of them, uniform ids), lookup ``f`` of
  the work, and every owner reduce-scatters a full ``[B*Q, cols]`` partial over all
  ranks (``(W-1)/W`` of it leaves the rank; charged at one NIC per GPU).
- table_row_wise: as row_wise, but the partial is reduce-scattered inside the host
  (``1 - f`` of it leaves the rank over the intra-host link: the reduce-scatter hands
  each rank the share of the batch that matches its share of the rows), and each rank
  sends its reduced share, ``f`` of ``[B*Q, cols]``, to the sources.
- grid_shard: each column piece is table_row_wise over ranks of one host; a shard is a
  block of rows of a piece ``cols`` wide, costed as table_row_wise (``f`` of all rows).
- data_parallel: local lookups only; backward all-reduces the whole table gradient
  (``rows*dim*4`` bytes) and the dense optimizer updates the whole table.

All-to-all bytes are split by destination: ``1/W`` stay on the rank, ``(L-1)/W`` go to
the other ranks of its host (intra-host link), the rest cross hosts (``L`` ranks per host).
Sequence tables (``EmbeddingConfig``) output one row per id instead of one per bag,
so for them every output term scales with ``f``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.planner.tables import TableSpec
from lightning_shardrec.planner.topology import Topology
from lightning_shardrec.planner.types import ShardingType

ID_BYTES = 8  # int64 ids
OUT_BYTES = 4  # fp32 pooled outputs and gradients
STATE_BYTES = 4  # fp32 optimizer state


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Everything besides the table that the cost model needs."""

    topology: Topology
    batch_size: int
    optimizer: EmbOptimType = EmbOptimType.ADAGRAD

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", EmbOptimType.parse(self.optimizer))
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(
                f"Workload: batch_size must be a positive int, got {self.batch_size!r}"
            )

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


def _compute(t: TableSpec, w: Workload, ids: float, cols: int) -> float:
    return (ids * cols * t.elem_bytes + _update_bytes(t, w, ids, cols)) / w.topology.memory_bw


def _table_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    frac = rows / t.rows
    ids = w.global_batch * t.ids_per_sample * frac
    out_rows = ids if t.sequence else w.global_batch * t.bags_per_sample * frac
    comm = a2a_seconds(ids * ID_BYTES + 2 * out_rows * cols * OUT_BYTES, w.topology)
    return comm + _compute(t, w, ids, cols)


def _row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    if t.sequence:  # every id to one owner, its row straight back: an all-to-all
        return _table_wise(t, w, rows, cols)
    topo = w.topology
    frac = rows / t.rows
    ids = w.global_batch * t.ids_per_sample * frac
    partial = w.global_batch * t.bags_per_sample * cols * OUT_BYTES
    scatter = 2 * partial * (topo.world_size - 1) / topo.world_size
    return a2a_seconds(ids * ID_BYTES, topo) + _over(scatter, topo.comm_bw) + _compute(t, w, ids, cols)


def _table_row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    if t.sequence:
        return _table_wise(t, w, rows, cols)
    topo = w.topology
    frac = rows / t.rows
    ids = w.global_batch * t.ids_per_sample * frac
    partial = w.global_batch * t.bags_per_sample * cols * OUT_BYTES
    inside = _over(2 * partial * (1 - frac), float(topo.intra_host_bw))  # type: ignore[arg-type]
    comm = a2a_seconds(ids * ID_BYTES + 2 * partial * frac, topo) + inside
    return comm + _compute(t, w, ids, cols)


def _data_parallel(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    topo = w.topology
    ids = w.batch_size * t.ids_per_sample
    lookup = ids * cols * t.elem_bytes + ids * cols * OUT_BYTES
    world = topo.world_size
    allreduce = 2 * (world - 1) / world * rows * cols * OUT_BYTES
    dense_update = rows * (2 * cols * t.elem_bytes + 2 * w.state_per_row(cols) * STATE_BYTES)
    return allreduce / topo.comm_bw + (lookup + dense_update) / topo.memory_bw


PERF: dict[ShardingType, Callable[[TableSpec, Workload, int, int], float]] = {
    ShardingType.TABLE_WISE: _table_wise,
    ShardingType.COLUMN_WISE: _table_wise,
    ShardingType.ROW_WISE: _row_wise,
    ShardingType.TABLE_ROW_WISE: _table_row_wise,
    ShardingType.GRID_SHARD: _table_row_wise,
    ShardingType.DATA_PARALLEL: _data_parallel,
}


def shard_perf(table: TableSpec, work: Workload, kind: ShardingType, rows: int, cols: int) -> float:
    """Seconds per step a ``rows x cols`` shard of ``table`` costs its rank."""
    return PERF[kind](table, work, rows, cols)
