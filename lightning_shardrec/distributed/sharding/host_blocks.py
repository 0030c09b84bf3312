"""Table-row-wise and grid sharding: row blocks whose pooled output is reduced among their holders.

The ids travel as for row-wise (:mod:`.row_blocks`); only the pooled way back differs.
A table-row-wise table (or a grid table's column piece) has its blocks on ranks of one
host, its *holders*; each holder pools partials ``[sum_s B_s, cols]`` of the piece for the
global batch, and the kernel's output holds only the pieces this rank has blocks of.
Then (:mod:`~lightning_shardrec.distributed.comm.hierarchy`):

1. an all-to-all inside the host sends each holder of a piece the rows of its chunk of
   the sources from the other holders, which it sums (NVLink on GPUs); ranks of the
   host that hold no block of the piece send and receive nothing for it;
2. an all-to-all over the group sends each source ``s`` its ``[B_s, cols]`` sums, and
   ``s`` puts every piece's columns in the group's lane order (the layout of
   :meth:`RowBlockSharding.output_dist`).

So no rank materialises ``[B_global, D]``, and nobody moves zeros. A piece whose blocks
span hosts (a hand-written plan) is a unit per host and its hosts' sums are added at the
source. Sequence tables keep the reverse all-to-all of :class:`RowBlockSharding` (every id
has one block: nothing to reduce).
"""

from __future__ import annotations

from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import ShardingEnv, scale_grad
from lightning_shardrec.distributed.comm.hierarchy import HolderExchange, Unit, host_group
from lightning_shardrec.distributed.sharding.base import KernelSetup, TableSharding
from lightning_shardrec.distributed.sharding.row_blocks import RowBlockSharding
from lightning_shardrec.sparse import KeyedJaggedTensor


class HostRowBlockSharding(RowBlockSharding):
    """Table-row-wise and grid tables of one collection: pooled output reduced among holders."""

    def __init__(self, tables: list[TableSharding], env: ShardingEnv, setup: KernelSetup) -> None:
        super().__init__(tables, env, setup)
        if not setup.pooled:
            return
        self.units = units_of(self._lanes, self.lane_columns, self.lane_ranks, self.local_lanes, env)
        #: this rank's columns of the kernel output (the pieces it holds blocks of)
        self.local_width = sum(len(self.lane_columns[j]) for j in self.local_lanes)
        self.exchange = HolderExchange(
            self.units, self.width, env, host_group(env), setup.device, self.comm_precision
        )  # collective

    def compute(self, kjt: KeyedJaggedTensor) -> Tensor:
        """Pooled: ``[sum_s B_s, D_local]`` partials of the pieces held here (no zero columns)."""
        if not self.setup.pooled:
            return super().compute(kjt)
        if self.kernel is None:
            return self.empty_output(kjt.stride(), 0)
        return self.kernel(kjt)

    def output_dist(self, out: Tensor, batch_sizes: list[int]) -> Tensor:
        """``[sum_s B_s, D_local]`` partials -> ``[B_r, width]``: holders' sums, then home."""
        return scale_grad(self.exchange(out, batch_sizes), 1.0 / self.env.world_size)


def units_of(
    lanes: list[tuple[int, int]],
    lane_columns: list[list[int]],
    lane_ranks: list[set[int]],
    local_lanes: list[int],
    env: ShardingEnv,
) -> list[Unit]:
    """One :class:`Unit` per (piece, host holding blocks of it), pieces in lane order, hosts ascending.

    ``lanes[j] = (feature, piece)``: a piece's lanes are its table's features, adjacent; a
    unit's columns are theirs, in lane order, and so are its columns of the kernel output.
    """
    width_at: dict[int, int] = {}
    at = 0
    for j in local_lanes:
        width_at[j] = at
        at += len(lane_columns[j])
    by_piece: dict[int, list[int]] = {}
    for j, (_, piece) in enumerate(lanes):
        by_piece.setdefault(piece, []).append(j)
    local = env.local_world_size
    units = []
    for js in by_piece.values():
        columns = tuple(c for j in js for c in lane_columns[j])
        ranks = lane_ranks[js[0]]
        for h in sorted({r // local for r in ranks}):
            holders = tuple(sorted(r for r in ranks if r // local == h))
            span = None
            if env.rank in holders:
                a = width_at[js[0]]
                span = (a, a + len(columns))
                if [width_at[j] for j in js] != [a + sum(len(lane_columns[i]) for i in js[:n]) for n in range(len(js))]:
                    raise RuntimeError(f"units_of: the lanes {js} of a piece are not adjacent in the kernel output")
            units.append(Unit(holders, columns, span))
    return units
