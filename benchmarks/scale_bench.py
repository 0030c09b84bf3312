"""Per-step bookkeeping of the output and input distributions at a simulated world size.

    python benchmarks/scale_bench.py [--worlds 8,64,512] [--batch 64] [--repeats 5] [--cases "row-wise,header"]

One process plays rank 0 of a ``W``-rank job: the collectives are replaced by local
stand-ins (an all-to-all copies what fits of its input into its output, a reduce-scatter
copies this rank's part, an all-gather repeats the input), so what is timed is the
Python loops, small copies and index building around them, plus one copy where the
real collective would move data. Per step (forward + backward where there is one), ms:

* ``pooled a2a``: table/column-wise output dist (``all_to_all_pooled``): ``W`` sources,
  each sending this rank a ``[B, 16]`` table slice.
* ``pooled a2a fp16``: the same with ``comm_precision="fp16"`` (``before``: the wire
  format's list of every peer's part and exponent).
* ``holders``: table-row-wise (``HolderExchange``), 8 ranks per host, one 16-wide table
  per host on all its ranks: host all-to-all, then the world all-to-all home.
* ``row-wise``: ``reduce_scatter_grad`` of a ``[W * B, 64]`` partial (backward: all-gather).
* ``row-wise bf16`` / ``fp16``: the same with ``comm_precision`` (``before``: a list per
  rank, fp16's per-peer wire list, and the backward's ``W``-times copy of the gradient).
* ``header``: the input dist's per-batch header, built and read (``_header``, ``_read_header``), 4 groups.

``B`` (``--batch``) is the per-rank batch size. Nothing here measures the network.
Each case runs twice, interleaved: ``before`` is the per-step code as it was before the
scale work (a copy per source in the pooled all-to-all, the holders' loops over every
source each step, the row-wise backward's ``W``-times copy of the gradient; kept below
as ``_legacy_*``), ``after`` is the library's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_shardrec.distributed.comm import collectives as comm
from lightning_shardrec.distributed.comm import pooled_all_to_all, qcomm
from lightning_shardrec.distributed.comm.collectives import ShardingEnv, all_to_all_grad, reduce_scatter_rows
from lightning_shardrec.distributed.comm.hierarchy import HolderExchange, Unit
from lightning_shardrec.distributed.comm.input_dist import Routed
from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks, all_to_all_pooled
from lightning_shardrec.distributed.comm.qcomm import CommPrecision, fp16_exponent
from lightning_shardrec.distributed.sharded.batch_dist import _header, _read_header, _read_rows
from lightning_shardrec.sparse import KeyedJaggedTensor

LOCAL = 8  # ranks per host


class _LegacyReduceScatter(torch.autograd.Function):
    """The former row-wise reduce-scatter: its backward sends ``W`` copies of the gradient."""

    @staticmethod
    def forward(ctx, env: ShardingEnv, *parts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.env, ctx.rows = env, [p.shape[0] for p in parts]
        out = parts[env.rank].new_empty(parts[env.rank].shape)
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=env.pg)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        env, rows = ctx.env, ctx.rows
        width = grad[0].numel()
        mine = grad.contiguous().reshape(-1)
        gathered = mine.new_empty(sum(rows) * width)
        dist.all_to_all_single(
            gathered, mine.repeat(env.world_size), [r * width for r in rows], [mine.numel()] * env.world_size
        )
        parts = gathered.split([r * width for r in rows])
        return (None, *(g.view(r, *grad.shape[1:]) for g, r in zip(parts, rows, strict=True)))


def _legacy_encode(x: torch.Tensor, splits: list[int], precision: CommPrecision) -> tuple[torch.Tensor, list[int]]:
    """The former fp16 wire encoder: a list of every peer's part and exponent, then a cat."""
    if precision is not CommPrecision.FP16:
        return qcomm.encode(x, splits, precision)
    e = fp16_exponent(x)
    y, eh = (x * torch.exp2(e)).half(), e.half().reshape(1)
    return torch.cat([t for part in y.split(splits) for t in (part, eh)]), [n + 1 for n in splits]


def _legacy_decode(wire: torch.Tensor, wire_splits: list[int], precision: CommPrecision) -> torch.Tensor:
    if precision is not CommPrecision.FP16:
        return qcomm.decode(wire, wire_splits, precision)
    return torch.cat([p[:-1].float() * torch.exp2(-p[-1:].float()) for p in wire.split(wire_splits)])


def _legacy_exchange(send: torch.Tensor, out_splits: list[int], in_splits: list[int], env: ShardingEnv, fp16: bool):
    """The former quantized all-to-all: fp16 cut into a list per peer, an exponent after each part."""
    precision = CommPrecision.FP16 if fp16 else CommPrecision.BF16
    wire, wire_in = _legacy_encode(send, in_splits, precision)
    wire_out = qcomm.wire_splits(out_splits, precision)
    recv = wire.new_empty(sum(wire_out))
    dist.all_to_all_single(recv, wire, wire_out, wire_in, group=env.pg)
    return _legacy_decode(recv, wire_out, precision)


class _LegacyReduceScatterQ(torch.autograd.Function):
    """The former bf16/fp16 reduce-scatter: per-rank lists, and a ``W``-times copy of the gradient."""

    @staticmethod
    def forward(ctx, env: ShardingEnv, fp16: bool, *parts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.env, ctx.rows, ctx.fp16 = env, [p.shape[0] for p in parts], fp16
        mine = parts[env.rank]
        send = torch.cat([p.reshape(-1) for p in parts])
        recv = _legacy_exchange(send, [mine.numel()] * env.world_size, [p.numel() for p in parts], env, fp16)
        return recv.view(env.world_size, *mine.shape).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        env, rows = ctx.env, ctx.rows
        width = grad[0].numel()
        mine = grad.contiguous().reshape(-1)
        splits = [r * width for r in rows]
        gathered = _legacy_exchange(mine.repeat(env.world_size), splits, [mine.numel()] * env.world_size, env, ctx.fp16)
        parts = gathered.split(splits)
        return (None, None, *(g.view(r, *grad.shape[1:]) for g, r in zip(parts, rows, strict=True)))


def _legacy_holders(self: HolderExchange, partial: torch.Tensor, batch_sizes: list[int]) -> torch.Tensor:
    """The former ``HolderExchange.__call__``: every split and span rebuilt, every source sliced, each step."""
    world = self.env.world_size
    offsets = [0]
    for b in batch_sizes:
        offsets.append(offsets[-1] + b)

    def rows(u: int, c: int) -> tuple[int, int]:
        chunk = self.units[u].chunk(c, world)
        return offsets[chunk.start], offsets[chunk.stop]

    def cols(u: int) -> int:
        return len(self.units[u].columns)

    def cut(span: tuple[int, int], local: Any) -> torch.Tensor:
        return partial[span[0] : span[1], local[0] : local[1]]

    own = {u: cut(rows(u, self.index[u]), self.units[u].local) for u in self.mine}
    anchor = partial.reshape(-1)[:0]
    if self.host_active:
        send, in_splits, out_splits = [anchor], [], []
        for q, us in enumerate(self.pairs):
            theirs = [rows(u, self.units[u].holders.index(self.h0 + q)) for u in us]
            send.extend(cut(span, self.units[u].local).reshape(-1) for u, span in zip(us, theirs, strict=True))
            in_splits.append(sum((span[1] - span[0]) * cols(u) for u, span in zip(us, theirs, strict=True)))
            out_splits.append(sum((rows(u, self.index[u])[1] - rows(u, self.index[u])[0]) * cols(u) for u in us))
        recv = all_to_all_grad(torch.cat(send), out_splits, in_splits, self.host)
        anchor = recv[:0]
        flat = [u for us in self.pairs for u in us]
        parts = recv.split([(rows(u, self.index[u])[1] - rows(u, self.index[u])[0]) * cols(u) for u in flat])
        for u, part in zip(flat, parts, strict=True):
            own[u] = own[u] + part.view(-1, cols(u))
    send, in_splits = [anchor], []
    for s, us in enumerate(self.send_to):
        for u in us:
            lo = offsets[s] - rows(u, self.index[u])[0]
            send.append(own[u][lo : lo + batch_sizes[s]].reshape(-1))
        in_splits.append(batch_sizes[s] * sum(cols(u) for u in us))
    b = batch_sizes[self.env.rank]
    out_splits = [b * sum(cols(u) for u in us) for us in self.recv_from]
    recv = all_to_all_grad(torch.cat(send), out_splits, in_splits, self.env)
    widths = [cols(u) for us in self.recv_from for u in us]
    got = torch.cat([p.view(b, w) for p, w in zip(recv.split([b * w for w in widths]), widths, strict=True)], 1)
    inverse = torch.empty_like(self._cols).index_put_((self._cols,), torch.arange(self._cols.numel()))
    return got.index_select(1, inverse)  # the benchmark's units are exclusive


def _a2a(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    n = min(out.numel(), inp.numel())
    out.reshape(-1)[:n].copy_(inp.reshape(-1)[:n])


def _reduce_scatter(out: torch.Tensor, parts: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
    out.copy_(parts[0])


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    out.reshape(-1).copy_(inp.reshape(-1)[: out.numel()])


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    out.view(-1, inp.numel()).copy_(inp.reshape(1, -1).expand(out.numel() // inp.numel(), -1))


@contextmanager
def fake_collectives():
    """The collectives rank 0 would call, replaced by local copies (no process group)."""
    names = {
        "all_to_all_single": _a2a,
        "reduce_scatter": _reduce_scatter,
        "reduce_scatter_single": _reduce_scatter_single,
        "reduce_scatter_tensor": _reduce_scatter_single,
        "all_gather_single": _all_gather_single,
        "all_gather_into_tensor": _all_gather_single,
    }
    saved = {n: getattr(dist, n, None) for n in names}
    for n, fn in names.items():
        setattr(dist, n, fn)
    try:
        yield
    finally:
        for n, fn in saved.items():
            if fn is None:
                delattr(dist, n)
            else:
                setattr(dist, n, fn)


def pooled_case(world: int, batch: int, before: bool) -> Callable[[], None]:
    env = ShardingEnv(0, world, None, LOCAL if world % LOCAL == 0 else world)
    width = 16
    layout = ColumnBlocks.from_columns(list(range(width * world)), [width] * world)
    x = torch.randn(batch * world, width, requires_grad=True)
    sizes = [batch] * world

    def step() -> None:
        pooled_all_to_all.GATHER_ABOVE = world if before else saved  # before: one copy per source
        out = all_to_all_pooled(x, sizes, layout, 1.0 / world, env)
        out.backward(torch.ones_like(out))
        pooled_all_to_all.GATHER_ABOVE = saved

    saved = pooled_all_to_all.GATHER_ABOVE

    return step


def pooled_fp16_case(world: int, batch: int, before: bool) -> Callable[[], None]:
    env = ShardingEnv(0, world, None, LOCAL if world % LOCAL == 0 else world)
    width = 16
    layout = ColumnBlocks.from_columns(list(range(width * world)), [width] * world)
    x = torch.randn(batch * world, width, requires_grad=True)
    sizes = [batch] * world

    def step() -> None:
        if before:  # the wire format's per-peer lists
            comm.encode, comm.decode = _legacy_encode, _legacy_decode
        out = all_to_all_pooled(x, sizes, layout, 1.0 / world, env, CommPrecision.FP16)
        out.backward(torch.ones_like(out))
        comm.encode, comm.decode = qcomm.encode, qcomm.decode

    return step


def holders_case(world: int, batch: int, before: bool) -> Callable[[], None]:
    env = ShardingEnv(0, world, None, LOCAL)
    host = ShardingEnv(0, LOCAL, None, LOCAL)
    width = 16
    units = [
        Unit(tuple(range(h * LOCAL, (h + 1) * LOCAL)), tuple(range(h * width, (h + 1) * width)), None)
        for h in range(world // LOCAL)
    ]
    units[0] = Unit(units[0].holders, units[0].columns, (0, width))  # rank 0 holds host 0's table
    exchange = HolderExchange(units, width * len(units), env, host, torch.device("cpu"))
    x = torch.randn(batch * world, width, requires_grad=True)
    sizes = [batch] * world

    def step() -> None:
        out = _legacy_holders(exchange, x, sizes) if before else exchange(x, sizes)
        out.backward(torch.ones_like(out))

    return step


def rowwise_case(world: int, batch: int, before: bool) -> Callable[[], None]:
    env = ShardingEnv(0, world, None, LOCAL if world % LOCAL == 0 else world)
    x = torch.randn(batch * world, 64, requires_grad=True)
    sizes = [batch] * world

    def step() -> None:
        rows = _LegacyReduceScatter.apply(env, *x.split(sizes)) if before else reduce_scatter_rows(x, sizes, env)
        rows.backward(torch.ones_like(rows))

    return step


def rowwise_low_case(precision: CommPrecision) -> Callable[[int, int, bool], Callable[[], None]]:
    def case(world: int, batch: int, before: bool) -> Callable[[], None]:
        env = ShardingEnv(0, world, None, LOCAL if world % LOCAL == 0 else world)
        x = torch.randn(batch * world, 64, requires_grad=True)
        sizes = [batch] * world
        fp16 = precision is CommPrecision.FP16

        def step() -> None:
            if before:
                rows = _LegacyReduceScatterQ.apply(env, fp16, *x.split(sizes))
            else:
                rows = reduce_scatter_rows(x, sizes, env, precision)
            rows.backward(torch.ones_like(rows))

        return step

    return case


def _legacy_header(kjt: KeyedJaggedTensor, routed: list[Routed], world: int, groups: int) -> list[list[int]]:
    """The former header: built and read row by row in Python."""
    splits = [r.value_splits for r in routed]
    rows = torch.tensor([[0, kjt.stride(), *(s[d] for s in splits)] for d in range(world)], dtype=torch.long).tolist()
    assert not [s for s, row in enumerate(rows) if row[0]]
    return [[row[2 + i] for row in rows] for i in range(groups)]


def header_case(world: int, batch: int, before: bool) -> Callable[[], None]:
    env = ShardingEnv(0, world, None, LOCAL if world % LOCAL == 0 else world)
    ids, lengths = torch.zeros(batch, dtype=torch.long), torch.ones(batch, dtype=torch.long)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, lengths)
    groups = 4
    routed: list[Routed | None] = [
        Routed(torch.empty(0), torch.empty(0), None, [batch] * world, [3] * world) for _ in range(groups)
    ]

    def step() -> None:
        if before:
            _legacy_header(kjt, routed, world, groups)  # type: ignore[arg-type]
        else:
            header = _header(kjt, routed, None, world, groups, torch.device("cpu"), None, None)
            rows, sent = _read_rows(header.clone(), header)  # the clone stands in for the exchange
            _read_header(rows, sent, None, env, groups)

    return step


CASES = {
    "pooled a2a": pooled_case,
    "pooled a2a fp16": pooled_fp16_case,
    "holders": holders_case,
    "row-wise": rowwise_case,
    "row-wise bf16": rowwise_low_case(CommPrecision.BF16),
    "row-wise fp16": rowwise_low_case(CommPrecision.FP16),
    "header": header_case,
}


def measure(step: Callable[[], None], repeats: int) -> float:
    """Median ms per step over ``repeats`` timings of enough steps for ~0.2 s each."""
    step()
    start = time.perf_counter()
    step()
    once = time.perf_counter() - start
    n = max(1, int(0.2 / max(once, 1e-6)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            step()
        times.append((time.perf_counter() - start) / n * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,512")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, B={args.batch}, 1 thread")
    print("| case | " + " | ".join(f"W={w}: before / after (ms)" for w in worlds) + " |")
    print("|---|" + "---:|" * len(worlds))
    with fake_collectives():
        for name in args.cases.split(","):
            case = CASES[name]
            cells = []
            for w in worlds:
                before, after = case(w, args.batch, True), case(w, args.batch, False)
                pairs = [(measure(before, 1), measure(after, 1)) for _ in range(args.repeats)]  # interleaved
                b, a = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
                cells.append(f"{b:.3f} / {a:.3f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
