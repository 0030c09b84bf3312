"""Storage half of the cost model: bytes a shard takes on its rank's table memory.

weights (``rows*cols*elem``) + optimizer state (``rows*state_per_row(cols)*4``) + a dynamic
table's id map (``rows * TableSpec.id_map_row_bytes``: 4 int64 and 4 bitmap bytes per slot, 3 int64 per candidate) +
buffers: the ids it receives (``*8``), and its output and output gradient (``*4`` each,
full ``[B*Q, cols]`` partials for row_wise / table_row_wise / grid_shard). data_parallel also keeps
a dense gradient of the whole table and only the local batch's buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning_shardrec.planner.costs.perf import ID_BYTES, OUT_BYTES, STATE_BYTES, Workload
from lightning_shardrec.planner.plans.tables import TableSpec
from lightning_shardrec.planner.plans.types import ShardingType


def _resident(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    return rows * (cols * t.elem_bytes + w.state_per_row(cols) * STATE_BYTES + t.id_map_row_bytes)


def _buffers(t: TableSpec, batch: int, frac: float, cols: int, partial_out: bool) -> float:
    ids = batch * t.ids_per_sample * frac
    out_rows = ids if t.sequence else batch * t.bags_per_sample * (1.0 if partial_out else frac)
    return ids * ID_BYTES + 2 * out_rows * cols * OUT_BYTES


def _table_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    return _resident(t, w, rows, cols) + _buffers(t, w.global_batch, rows / t.rows, cols, False)


def _row_wise(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    return _resident(t, w, rows, cols) + _buffers(t, w.global_batch, rows / t.rows, cols, True)


def _data_parallel(t: TableSpec, w: Workload, rows: int, cols: int) -> float:
    dense_grad = rows * cols * OUT_BYTES
    return _resident(t, w, rows, cols) + dense_grad + _buffers(t, w.batch_size, 1.0, cols, False)


STORAGE: dict[ShardingType, Callable[[TableSpec, Workload, int, int], float]] = {
    ShardingType.TABLE_WISE: _table_wise,
    ShardingType.COLUMN_WISE: _table_wise,
    ShardingType.ROW_WISE: _row_wise,
    ShardingType.TABLE_ROW_WISE: _row_wise,
    ShardingType.GRID_SHARD: _row_wise,
    ShardingType.DATA_PARALLEL: _data_parallel,
}


def shard_storage(
    table: TableSpec, work: Workload, kind: ShardingType, rows: int, cols: int
) -> int:
    """Bytes a ``rows x cols`` shard of ``table`` needs on its rank."""
    return math.ceil(STORAGE[kind](table, work, rows, cols))


def id_map_bytes(table: TableSpec) -> int:
    """Bytes of a dynamic table's id map (its mapper's buffers), 0 for a static table."""
    return math.ceil(table.rows * table.id_map_row_bytes)


def resident_bytes(table: TableSpec, work: Workload) -> tuple[int, int]:
    """``(weights, optimizer state)`` bytes of the whole table."""
    weights = math.ceil(table.rows * table.dim * table.elem_bytes)
    state = table.rows * work.state_per_row(table.dim) * STATE_BYTES
    return weights, state
