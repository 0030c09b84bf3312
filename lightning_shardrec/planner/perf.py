"""Perf half of the cost model: seconds per training step that a shard costs its rank.

For a global batch ``B = batch_size * world_size``, ``P`` ids and ``Q`` bags per sample,
a shard of ``rows x cols`` holding the share ``f = rows / table_rows``:

- table_wise / column_wise (``f = 1``): ids all-to-all in (``B*P*8`` bytes), lookup of
  ``B*P*cols`` elements on the owner, pooled ``[B*Q, cols]`` all-to-all out; backward
  sends the same gradient back and updates the rows (weights + optimizer state).
- row_wise: ids bucketized to row owners (``f`` of them, uniform ids), lookup ``f`` of
  the work, and every owner sends a full ``[B*Q, cols]`` partial (reduce-scatter).
- table_row_wise: as row_wise, the partial reduced inside the host (intra-host link),
  the host's reduced result sent across hosts in proportion to ``f``.
- data_parallel: local lookups only; backward all-reduces the whole table gradient
  (``rows*dim*4`` bytes) and the dense optimizer updates the whole table.

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


def _a2a_perf(t: TableSpec, w: Workload, frac: float, cols: int, partial_out: bool) -> float:
    topo = w.topology
    ids = w.global_batch * t.ids_per_sample * frac
    if t.sequence:
        out_rows = ids
    else:
        out_rows = w.global_batch * t.bags_per_sample * (1.0 if partial_out else frac)
    comm = ids * ID_BYTES + 2 * out_rows * cols * OUT_BYTES
    compute = ids * cols * t.elem_bytes + _update_bytes(t, w, ids, cols)
    return comm / topo.comm_bw + compute / topo.memory_bw


def _table_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    return _a2a_perf(t, w, rows / t.rows, cols, partial_out=False)


def _row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    return _a2a_perf(t, w, rows / t.rows, cols, partial_out=True)


def _table_row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    topo = w.topology
    intra = float(topo.intra_host_bw or 0.0)
    frac = rows / t.rows
    if t.sequence:
        return _a2a_perf(t, w, frac, cols, partial_out=False)
    ids = w.global_batch * t.ids_per_sample * frac
    out = w.global_batch * t.bags_per_sample * cols * OUT_BYTES
    comm = ids * ID_BYTES / topo.comm_bw + 2 * out / intra + 2 * out * frac / topo.comm_bw
    compute = ids * cols * t.elem_bytes + _update_bytes(t, w, ids, cols)
    return comm + compute / topo.memory_bw


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
    ShardingType.DATA_PARALLEL: _data_parallel,
}


def shard_perf(table: TableSpec, work: Workload, kind: ShardingType, rows: int, cols: int) -> float:
    """Seconds per step a ``rows x cols`` shard of ``table`` costs its rank."""
    return PERF[kind](table, work, rows, cols)
