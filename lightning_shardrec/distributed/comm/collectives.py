"""Collectives the sharded modules use, on gloo (CPU) and NCCL (CUDA) alike.

``torch.distributed`` primitives: all-to-all with uneven splits (plain for ids,
autograd-aware for embeddings, whose backward is the reverse all-to-all) and
reduce-scatter (backward: all-gather). When a :class:`ShardingEnv` carries a same-host
transport (:mod:`~lightning_shardrec.distributed.transport.shm`, gloo groups only), the all-to-alls, the row-wise
reduce-scatter and its all-gather of CPU tensors go through shared memory instead,
with the same results (sums in rank order).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.distributed.comm.qcomm import (
    CommPrecision,
    WirePrecision,
    decode,
    decode_rows,
    directions,
    encode,
    encode_rows,
    wire_splits,
    wire_width,
)
from lightning_shardrec.distributed.comm.transport import Transport, Waitable
from lightning_shardrec.planner.machine.mesh import host_mesh, mesh_layout
from lightning_shardrec.planner.machine.topology import local_world_size_from_env


@dataclass(frozen=True)
class ShardingEnv:
    """Where a sharded module lives: its process group, rank, world size and ranks per host.

    Ranks ``h*L .. h*L+L-1`` form host ``h`` (``L = local_world_size``), as the planner's
    ``Topology`` assumes. On the default group :meth:`from_process_group` takes the layout from the
    host mesh (:func:`~lightning_shardrec.planner.machine.mesh.host_mesh`); ``local_world_size=0`` otherwise takes
    ``LOCAL_WORLD_SIZE`` (or the SLURM / ``NUM_NODES`` equivalents) when it divides ``world_size``, else one host.
    """

    rank: int
    world_size: int
    pg: dist.ProcessGroup | None = None
    local_world_size: int = 0
    #: another way to move CPU tensors among these ranks (:class:`~.transport.Transport`: the same-host shared
    #: memory of ``comm_transport="auto"``); None: ``pg``'s
    transport: Transport | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        local = self.local_world_size or local_world_size_from_env(self.world_size)
        if not isinstance(local, int) or local <= 0 or self.world_size % local:
            raise ValueError(
                f"ShardingEnv: local_world_size (ranks per host) must be a positive int dividing "
                f"world_size {self.world_size}, got {self.local_world_size!r}"
            )
        object.__setattr__(self, "local_world_size", local)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    @staticmethod
    def from_process_group(pg: dist.ProcessGroup | None = None, local_world_size: int = 0) -> ShardingEnv:
        if not dist.is_initialized():
            raise RuntimeError(
                "sharding needs an initialised process group: call torch.distributed.init_process_group "
                "(or train with Trainer(strategy='shardrec'))"
            )
        if pg is None or pg is dist.group.WORLD:  # ranks per host: the host mesh's (collective the first time)
            local_world_size = mesh_layout(host_mesh(local_world_size))[1]
        return ShardingEnv(dist.get_rank(pg), dist.get_world_size(pg), pg, local_world_size)

    @staticmethod
    def from_local(world_size: int, rank: int) -> ShardingEnv:
        """TorchRec's env without a process group (``DistributedModelParallel`` then uses the default group)."""
        return ShardingEnv(rank, world_size, None)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """TorchRec's name for ``pg``."""
        return self.pg


def all_to_all_single(
    out: Tensor,
    inp: Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    env: ShardingEnv,
    async_op: bool = False,
) -> Waitable | None:
    """``dist.all_to_all_single`` on ``env``: through its same-host transport for CPU tensors, else its group.

    Splits count rows (None: equal). With ``async_op`` returns the handle to ``wait()`` on.
    """
    if env.transport is not None and inp.device.type == "cpu":
        work = env.transport.all_to_all(out, inp, out_splits, in_splits)
        if async_op:
            return work
        work.wait()
        return None
    return dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=env.pg, async_op=async_op)


def all_to_all(tensor: Tensor, out_splits: list[int], in_splits: list[int], env: ShardingEnv) -> Tensor:
    """Uneven all-to-all of a 1-D (or row-split 2-D) tensor, no autograd (ids, lengths)."""
    out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
    if env.world_size == 1:
        return tensor
    all_to_all_single(out, tensor, out_splits, in_splits, env)
    return out


def all_to_all_async(
    tensor: Tensor, out_splits: list[int], in_splits: list[int], env: ShardingEnv
) -> tuple[Tensor, Waitable | None]:
    """:func:`all_to_all` issued with ``async_op=True``: ``(out, work)``; ``out`` is valid after ``work.wait()``."""
    if env.world_size == 1:
        return tensor, None
    out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
    return out, all_to_all_single(out, tensor, out_splits, in_splits, env, async_op=True)


def all_to_all_grad(
    tensor: Tensor,
    out_splits: list[int],
    in_splits: list[int],
    env: ShardingEnv,
    precision: CommPrecision | WirePrecision = CommPrecision.FP32,
) -> Tensor:
    """Uneven all-to-all along dim 0 whose backward sends gradients back the same way.

    ``precision`` below fp32 sends in bf16/fp16 (:mod:`.qcomm`; a :class:`WirePrecision`: the
    output in its ``forward``, the gradient in its ``backward`` format); fp32 tensors only.
    """
    if env.world_size == 1:
        return tensor
    return _AllToAllV.apply(tensor, out_splits, in_splits, env, precision)


def backend_uses_cuda(backend: str) -> bool:
    """Whether a process group backend, as :func:`torch.distributed.get_backend` spells it, takes
    CUDA tensors: ``"nccl"``, ``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"`` (any case, spaces, order) do,
    ``"gloo"`` and ``"cpu:gloo"`` do not."""
    for part in str(backend).lower().split(","):
        device, _, name = part.strip().rpartition(":")
        if device.strip() == "cuda" or (not device and name.strip() == "nccl"):
            return True
    return False


def uses_cuda(pg: dist.ProcessGroup | None) -> bool:
    """Whether ``pg`` (None: the default group) runs its collectives on CUDA tensors."""
    return backend_uses_cuda(dist.get_backend(pg))


def sum_over_ranks(values: list[float], env: ShardingEnv) -> list[float]:
    """Collective: the element-wise sum of every rank's ``values`` (same length everywhere)."""
    if env.world_size == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda(env.pg) else None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=env.pg)
    return [float(v) for v in t.tolist()]


def exchange_flat(
    send: Tensor, out_splits: list[int], in_splits: list[int], env: ShardingEnv, precision: CommPrecision
) -> Tensor:
    """1-D all-to-all of element counts ``in_splits`` -> ``out_splits`` in ``precision``; fp32 out.

    bf16 through a same-host transport is cast inside its copies (no encoded or decoded buffers).
    """
    if precision is CommPrecision.BF16 and env.transport is not None and send.device.type == "cpu":
        recv = send.new_empty(sum(out_splits))
        env.transport.all_to_all(recv, send, out_splits, in_splits, wire=torch.bfloat16).wait()
        return recv
    wire, wire_in = encode(send, in_splits, precision)
    wire_out = wire_splits(out_splits, precision)
    recv = wire.new_empty(sum(wire_out))
    all_to_all_single(recv, wire, wire_out, wire_in, env)
    return decode(recv, wire_out, precision)


def reduce_scatter_grad(
    parts: list[Tensor], env: ShardingEnv, precision: CommPrecision | WirePrecision = CommPrecision.FP32
) -> Tensor:
    """Sum ``parts[r]`` over ranks onto rank ``r`` (uneven sizes allowed); backward all-gathers.

    ``precision`` below fp32: :func:`reduce_scatter_rows` of the parts side by side.

    For row blocks of one tensor prefer :func:`reduce_scatter_rows` (no per-rank list).
    """
    if env.world_size == 1:
        return parts[0]
    if directions(precision) != (CommPrecision.FP32, CommPrecision.FP32):
        return reduce_scatter_rows(torch.cat(parts), [p.shape[0] for p in parts], env, precision)
    return _ReduceScatterV.apply(env, *parts)


def reduce_scatter_rows(
    x: Tensor, rows: list[int], env: ShardingEnv, precision: CommPrecision | WirePrecision = CommPrecision.FP32
) -> Tensor:
    """Sum ``x``'s row block ``r`` (``x.split(rows)[r]``) over ranks onto rank ``r``; backward all-gathers.

    Equal blocks use the single-tensor collectives (no per-rank list, no copies); uneven ones
    reduce-scatter a list and all-gather padded to the largest block. Neither builds a
    ``W``-times copy of anything. On a same-host transport: one all-to-all of the blocks and a
    sum in rank order (with 2 ranks bit-identical to gloo's), the gradient gathered back alike.

    ``precision`` below fp32: the blocks travel in bf16/fp16 by one equal all-to-all of a
    ``[W, block]`` wire buffer (the same bytes per rank as a ring reduce-scatter) and are
    summed in fp32 on arrival; the gradient is all-gathered in bf16/fp16 (:mod:`.qcomm`).
    Uneven blocks are padded to the largest. A :class:`WirePrecision` sends the blocks in its
    ``forward`` and gathers the gradient in its ``backward`` format (either may be fp32).
    """
    if env.world_size == 1:
        return x
    fwd, bwd = directions(precision)
    if (fwd, bwd) != (CommPrecision.FP32, CommPrecision.FP32):
        return _ReduceScatterRowsQ.apply(x, rows, env, fwd, bwd)
    return _ReduceScatterRows.apply(x, rows, env)


def _reduce_scatter_single(out: Tensor, x: Tensor, group: dist.ProcessGroup | None) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


def _all_gather_single(out: Tensor, x: Tensor, group: dist.ProcessGroup | None) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rows: list[int], env: ShardingEnv) -> Tensor:  # type: ignore[override]
        ctx.rows, ctx.env = rows, env
        if env.transport is not None and x.device.type == "cpu":  # same host: sums in rank order
            return env.transport.reduce_scatter(x, rows)
        out = x.new_empty((rows[env.rank], *x.shape[1:]))
        if rows.count(rows[0]) == len(rows):
            _reduce_scatter_single(out, x.contiguous(), env.pg)
        else:
            dist.reduce_scatter(out, [p.contiguous() for p in x.split(rows)], group=env.pg)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _gather_rows(grad, ctx.rows, ctx.env), None, None


class _ReduceScatterRowsQ(torch.autograd.Function):
    """:func:`reduce_scatter_rows` in bf16/fp16: buffers shaped ``[W, ...]``, no per-rank list."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, rows: list[int], env: ShardingEnv, precision: CommPrecision, backward: CommPrecision
    ) -> Tensor:
        ctx.rows, ctx.env, ctx.precision = rows, env, backward
        width, most = math.prod(x.shape[1:]), max(rows)
        send = _pad_blocks(x.reshape(sum(rows), width), rows).view(env.world_size, most * width)
        wire = encode_rows(send, precision)
        recv = torch.empty_like(wire)
        all_to_all_single(recv, wire, None, None, env)  # row s of recv: source s's block for this rank
        got = decode_rows(recv, precision)
        mine = rows[env.rank]
        got = got if mine == most else got[:, : mine * width]
        return got.sum(0).view(mine, *x.shape[1:])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        rows, env, precision = ctx.rows, ctx.env, ctx.precision
        width, most = math.prod(grad.shape[1:]), max(rows)
        mine = grad.contiguous().reshape(-1)
        if rows[env.rank] != most:
            mine = torch.cat([mine, mine.new_zeros((most - rows[env.rank]) * width)])
        wire = encode_rows(mine.view(1, -1), precision).view(-1)
        gathered = wire.new_empty(env.world_size * wire.numel())
        _all_gather_single(gathered, wire, env.pg)
        rows_of = decode_rows(gathered.view(env.world_size, wire_width(most * width, precision)), precision)
        back = _unpad_blocks(rows_of.reshape(env.world_size * most, width), rows)
        return back.view(sum(rows), *grad.shape[1:]), None, None, None, None


def _keep(rows: list[int], most: int, device: torch.device) -> Tensor:
    """Where block ``r``'s ``rows[r]`` rows sit in blocks of ``most``: ``rows [1, 3], most 3 -> [0, 3, 4, 5]``."""
    keep = torch.cat([torch.arange(r * most, r * most + n) for r, n in enumerate(rows)])  # rare: uneven batches
    return keep.to(device, non_blocking=True)


def _pad_blocks(x: Tensor, rows: list[int]) -> Tensor:
    """``[sum(rows), n]`` -> ``[W * max(rows), n]``, block ``r`` zero-padded (a view when even)."""
    most = max(rows)
    if rows.count(most) == len(rows):
        return x.contiguous()
    out = x.new_zeros((most * len(rows), x.shape[1]))
    return out.index_copy_(0, _keep(rows, most, x.device), x)


def _unpad_blocks(x: Tensor, rows: list[int]) -> Tensor:
    """Inverse of :func:`_pad_blocks`."""
    most = max(rows)
    return x if rows.count(most) == len(rows) else x.index_select(0, _keep(rows, most, x.device))


def _gather_rows(grad: Tensor, rows: list[int], env: ShardingEnv) -> Tensor:
    """All-gather of every rank's ``[rows[r], ...]`` gradient into ``[sum(rows), ...]`` (padded when uneven)."""
    if env.transport is not None and grad.device.type == "cpu":
        return env.transport.all_gather(grad.contiguous(), rows)
    most = max(rows)
    mine = grad.contiguous()
    if rows[env.rank] != most:
        mine = torch.cat([mine, mine.new_zeros((most - rows[env.rank], *mine.shape[1:]))])
    gathered = mine.new_empty((most * env.world_size, *mine.shape[1:]))
    _all_gather_single(gathered, mine, env.pg)
    if rows.count(most) == len(rows):
        return gathered
    return gathered.index_select(0, _keep(rows, most, gathered.device))


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        env: ShardingEnv,
        precision: CommPrecision | WirePrecision,
    ) -> Tensor:
        fwd, bwd = directions(precision)
        ctx.splits, ctx.env, ctx.precision = (out_splits, in_splits), env, bwd
        return _all_to_all_rows(x, out_splits, in_splits, env, fwd)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _all_to_all_rows(grad, in_splits, out_splits, ctx.env, ctx.precision), None, None, None, None


def _all_to_all_rows(
    x: Tensor, out_splits: list[int], in_splits: list[int], env: ShardingEnv, precision: CommPrecision
) -> Tensor:
    """All-to-all of rows (``splits`` count rows of ``x.shape[1:]``) in ``precision``."""
    if precision is CommPrecision.FP32:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        all_to_all_single(out, x, out_splits, in_splits, env)
        return out
    row = math.prod(x.shape[1:])
    flat = x.contiguous().reshape(-1)
    recv = exchange_flat(flat, [s * row for s in out_splits], [s * row for s in in_splits], env, precision)
    return recv.view(sum(out_splits), *x.shape[1:])


class _ReduceScatterV(torch.autograd.Function):
    """Uneven reduce-scatter; its backward is the uneven all-gather of the gradients."""

    @staticmethod
    def forward(ctx, env: ShardingEnv, *parts: Tensor) -> Tensor:  # type: ignore[override]
        ctx.env, ctx.rows = env, [p.shape[0] for p in parts]
        mine = parts[env.rank]
        out = mine.new_empty(mine.shape)
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=env.pg)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        gathered = _gather_rows(grad, ctx.rows, ctx.env)
        return (None, *gathered.split(ctx.rows))


def exchange_header(rows: Tensor, env: ShardingEnv) -> Tensor:
    """All-to-all of a small int64 ``[W, K]`` matrix: row ``d`` goes to rank ``d``.

    Returns ``[W, K]`` where row ``s`` came from rank ``s``. Used once per batch for
    batch sizes, id counts and failure flags, so no rank enters a bulk collective
    that another rank will never join.
    """
    if env.world_size == 1:
        return rows
    out = torch.empty_like(rows)
    all_to_all_single(out, rows, None, None, env)
    return out


def exchange_header_async(rows: Tensor, env: ShardingEnv) -> tuple[Tensor, Waitable | None]:
    """:func:`exchange_header` issued with ``async_op=True``: ``(out, work)``."""
    if env.world_size == 1:
        return rows, None
    out = torch.empty_like(rows)
    return out, all_to_all_single(out, rows, None, None, env, async_op=True)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """Identity forward; multiplies the gradient by ``scale`` (1/W: DDP's averaging)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def on_stream(stream: torch.cuda.Stream | None) -> AbstractContextManager[object]:
    """``torch.cuda.stream(stream)``, or nothing when there is no side stream (CPU)."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)
