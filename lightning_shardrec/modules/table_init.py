"""Seeded, block-independent table init: every block of a table is a function of (seed, row, col).

A collection takes one seed per table from torch's global CPU generator when it
creates the table (:func:`table_seeds`: read from a fork of the generator and mixed with the
table's name, so the global stream is left untouched, on ``meta`` as under TorchRec, and the
dense layers built after it see the same stream whether the table is real or on ``meta``),
and keeps it (:class:`SeededTables`). TorchRec draws each table's rows from the global stream in
construction order, so two collections of one model with a same-named table start with different
rows; here the k-th table of a name built while one module is under construction (the outermost
``nn.Module`` whose ``__init__`` is running) has its seed mixed with k as well, which gives the
same: different rows, and equal ones for the same model built again after the same seed. Rows ``[r0, r0 + n)`` x columns
``[c0, c0 + m)`` of the default uniform init are a counter-based hash of
``(seed, row, col)`` (:func:`init_block`), so a shard initialised on its own on any
rank and device equals the same block of the whole table, bit for bit::

    init_block(config, seed, full)                      # the whole [rows, dim] table
    init_block(config, seed, shard, r0=64, c0=8)        # == full[64:64+n, 8:8+m]

A custom ``init_fn`` cannot be evaluated block by block: it is called on the whole
table (torch's RNG seeded from the table seed, the global stream untouched); a shard
of a table that was never built whole (built on ``meta``) gets ``init_fn`` on the shard
alone, seeded from (seed, r0, c0), and differs from the whole table's block.

:func:`tables_on_meta` makes collections built inside it without a ``device`` put
their tables on ``meta`` (``ShardRecStrategy.tensor_init_context`` enters it).
"""

from __future__ import annotations

import inspect
import weakref
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
from torch import Tensor, nn

from lightning_shardrec.configs import BaseEmbeddingConfig, UniformInit
from lightning_shardrec.modules.dynamic.hashing import _C1, _C2, GOLDEN, mix64
from lightning_shardrec.modules.dynamic.native import native_loops
from lightning_shardrec.modules.dynamic.ops import write_uniform_rows as write_rows

_ON_META: ContextVar[bool] = ContextVar("lightning_shardrec_tables_on_meta", default=False)
_BLOCK_CPU = 1 << 15  # elements hashed at once by tensor ops on CPU (the tests' twin): scratch stays in cache
_BLOCK_CUDA = 1 << 24  # on CUDA: few launches
_BLOCK_NUMPY = 1 << 16  # on CPU (numpy's uint64 passes): measured fastest of 2**13..2**16
_SEEDS = 1 << 62
_NTH = 0xD1B54A32D192ED03  # mixed in k times for the k-th same-named table of one module under construction
#: per module under construction: how many tables of each name its collections built so far
_BUILT: weakref.WeakKeyDictionary[nn.Module, dict[str, int]] = weakref.WeakKeyDictionary()
_U64 = np.uint64
_MIX = ((_U64(30), _U64(0xBF58476D1CE4E5B9)), (_U64(27), _U64(0x94D049BB133111EB)), (_U64(31), None))


@contextmanager
def tables_on_meta() -> Iterator[None]:
    """Collections built inside (with ``device=None``) create their tables on ``meta``."""
    token = _ON_META.set(True)
    try:
        yield
    finally:
        _ON_META.reset(token)


def table_device(device: torch.device | str | None) -> torch.device | str | None:
    """Where a collection creates its tables: ``meta`` under :func:`tables_on_meta` when no device is given."""
    return "meta" if device is None and _ON_META.get() else device


def draw_seed() -> int:
    """A table seed in ``[0, 2**62)``: one draw from torch's global CPU generator."""
    return int(torch.randint(0, _SEEDS, (1,), device="cpu").item())


def table_seeds(names: Sequence[str], collection: object = None) -> dict[str, int]:
    """A seed in ``[0, 2**62)`` per table: the next draws of torch's global CPU generator, read from a fork
    of it (the global stream does not move), each mixed with its table's name (two tables of one
    collection never share a seed) and with how many same-named tables the module under construction
    already built (:func:`model_under_construction`; ``collection`` is the one drawing): collections of
    one model built one after the other give a same-named table different rows, as TorchRec's (which
    draw the rows from the global stream in construction order). Outside any module's ``__init__``
    (a script's top level, Lightning's ``configure_model``) back-to-back collections with no draw in
    between give same-named tables the same rows."""
    with torch.random.fork_rng(devices=[]):
        draws = [draw_seed() for _ in names]
    model = model_under_construction(collection)
    try:
        built = _BUILT.setdefault(model, {}) if model is not None else {}
    except TypeError:  # a module class that is not hashable (``__eq__`` without ``__hash__``)
        built = {}
    seeds = {}
    for n, d in zip(names, draws, strict=True):
        k = built.get(n, 0)
        built[n] = k + 1
        seeds[n] = (d ^ (zlib.crc32(n.encode()) * 0x9E3779B97F4A7C15) ^ (k * _NTH)) % _SEEDS
    return seeds


def model_under_construction(collection: object = None) -> nn.Module | None:
    """The outermost ``nn.Module`` (other than ``collection``) whose ``__init__`` is on the call stack."""
    found, frame = None, inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module) and obj is not collection:
                found = obj
        frame = frame.f_back
    return found


def unit_uniform(row_seeds: Tensor, c0: int, cols: int) -> Tensor:
    """``[len(row_seeds), cols]`` float64 in ``[0, 1)``: the top 53 bits of
    ``mix64(row_seed + (c0 + j) * GOLDEN)`` for column ``c0 + j``, times ``2**-53``
    (hashed a block of rows at a time, as :func:`init_block`)."""
    return _uniform_rows(row_seeds, c0, cols, None, torch.float64)


def uniform_rows(row_seeds: Tensor, cols: int, low: float | Tensor, high: float | Tensor, dtype: torch.dtype) -> Tensor:
    """``[len(row_seeds), cols]`` of ``dtype``: ``low + (high - low) * unit_uniform(row_seeds, 0, cols)``
    in float64, then rounded to ``dtype`` (bit for bit the same), a block of rows at a time.

    ``low`` and ``high`` are floats, or float64 tensors of one bound per row (rows of several tables).
    """
    return _uniform_rows(row_seeds, 0, cols, (low, high), dtype)


def _uniform_rows(
    row_seeds: Tensor, c0: int, cols: int, bounds: tuple[float | Tensor, float | Tensor] | None, dtype: torch.dtype
) -> Tensor:
    if row_seeds.device.type == "cpu":
        out = torch.empty(len(row_seeds), cols, dtype=dtype)
        _uniform_cpu(row_seeds, c0, bounds, out, via_float32=False)
        return out
    return _uniform_torch(row_seeds, c0, cols, bounds, dtype)


def _uniform_torch(
    row_seeds: Tensor, c0: int, cols: int, bounds: tuple[float | Tensor, float | Tensor] | None, dtype: torch.dtype
) -> Tensor:
    """:func:`_uniform_rows` as tensor ops on ``row_seeds``' device (CUDA; on CPU the tests' twin)."""
    rows, where = len(row_seeds), row_seeds.device
    out = torch.empty(rows, cols, dtype=dtype, device=where)
    step = max(1, (_BLOCK_CUDA if where.type == "cuda" else _BLOCK_CPU) // max(cols, 1))
    z = torch.empty(min(step, rows), cols, dtype=torch.int64, device=where)
    tmp, col = torch.empty_like(z), _columns(c0, cols, where)
    unit = out if dtype == torch.float64 else torch.empty(z.shape, dtype=torch.float64, device=where)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        u = unit[start : start + n] if unit is out else unit[:n]
        _unit(row_seeds[start : start + n], col, z[:n], tmp[:n], u)
        if bounds is not None:
            low, span = bounds[0], bounds[1] - bounds[0]
            if isinstance(span, Tensor):  # one bound per row: this block's rows
                span, low = span[start : start + n, None], low[start : start + n, None]  # type: ignore[index]
            u.mul_(span).add_(low)
        if unit is not out:
            out[start : start + n] = u
    return out


@torch.compiler.disable  # numpy's uint64 ops, run as they are (dynamo would trace them as torch ops)
def _uniform_cpu(
    row_seeds: Tensor | tuple[int, int],
    c0: int,
    bounds: tuple[float | Tensor, float | Tensor] | None,
    out: Tensor,
    via_float32: bool,
) -> None:
    """:func:`_uniform_rows` (``via_float32``: :func:`init_block`'s rounding) into CPU ``out [rows, cols]``
    with numpy's uint64 ops: a logical shift is one pass (torch's int64 ``>>`` needs a mask
    after it), so the hash takes 8 passes instead of 12. Bit for bit the tensor ops' result:
    ``u * span + low`` with ``u = (z >> 11) * 2**-53`` is computed as ``(z >> 11) * (span * 2**-53)
    + low`` (scaling by a power of two is exact), in float64.

    ``row_seeds``: a tensor ``[rows]``, or ``(r0, seed)`` for a table's rows ``[r0, r0 + rows)``
    (:func:`_row_seeds`, made a block at a time). One thread: splitting the rows over two
    threads measured slower on the 2 loaded cores of the benchmark machine.
    """
    rows, cols = out.shape
    if rows == 0 or cols == 0:
        return
    step = max(1, _BLOCK_NUMPY // cols)
    if isinstance(row_seeds, Tensor):
        seeds = row_seeds.to(torch.int64, copy=False).cpu()
    # mix64 adds GOLDEN first: column j's term (c0 + j) * GOLDEN and that GOLDEN, folded (mod 2**64)
    col = _columns(c0 + 1, cols, torch.device("cpu"))
    direct = out.device.type == "cpu" and (
        out.dtype == torch.float32 or (out.dtype == torch.float64 and not via_float32)
    )
    scale: float | np.ndarray = 2.0**-53
    low: float | np.ndarray = 0.0
    if bounds is not None:
        lo, hi = (b.to(torch.float64).expand(rows).numpy() if isinstance(b, Tensor) else float(b) for b in bounds)
        scale, low = (hi - lo) * 2.0**-53, lo

    z_torch = torch.empty(min(step, rows), cols, dtype=torch.int64)  # the same memory as z
    z = z_torch.numpy().view(_U64)
    tmp, unit = np.empty_like(z), np.empty(z.shape, dtype=np.float64)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        zz, tt, uu = z[:n], tmp[:n], unit[:n]
        if isinstance(row_seeds, Tensor):
            block_seeds = seeds[start : start + n]
        else:
            block_seeds = _row_seeds(row_seeds[0] + start, n, row_seeds[1], torch.device("cpu"))
        torch.add(block_seeds[:, None], col, out=z_torch[:n])  # torch broadcasts this faster
        for shift, mult in _MIX:
            np.right_shift(zz, shift, out=tt)
            np.bitwise_xor(zz, tt, out=zz)
            if mult is not None:
                np.multiply(zz, mult, out=zz)
        np.right_shift(zz, _U64(11), out=zz)
        uu[...] = zz.view(np.int64)  # < 2**53: int64's conversion (vectorised; uint64's is not everywhere)
        # the last float64 op writes straight into float32/float64 ``out`` (in float64, then rounded)
        dst = out[start : start + n].detach().numpy() if direct else uu
        if bounds is not None:
            sc, lw = (v[start : start + n, None] if isinstance(v, np.ndarray) else v for v in (scale, low))
            np.multiply(uu, sc, out=uu)
            np.add(uu, lw, out=dst, casting="same_kind")
        else:
            np.multiply(uu, scale, out=dst, casting="same_kind")
        if not direct:
            block = torch.from_numpy(uu)
            out[start : start + n] = block.float() if via_float32 and out.dtype != torch.float32 else block


def write_uniform_rows(weight: Tensor, rows: Tensor, row_seeds: Tensor, low: Tensor, high: Tensor) -> None:
    """``weight[rows] = uniform_rows(row_seeds, dim, low, high, weight.dtype)``: ``rows``,
    ``row_seeds``, ``low`` and ``high`` are ``[n]`` (integer, integer, float, float), ``rows`` in
    ``[0, len(weight))`` (checked by the compiled loop before it writes, else by ``index_copy_``). Dynamic tables' fresh
    rows: on CPU (float32/float64 rows of unit stride) written in place by the compiled loop
    where it is built (4300 rows of 64: 2-3.5x faster than the numpy rows and a copy)."""
    n = rows.shape[0] if rows.dim() == 1 else -1
    shapes = [tuple(t.shape) for t in (rows, row_seeds, low, high)]
    if weight.dim() != 2 or n < 0 or any(s != (n,) for s in shapes):
        raise ValueError(
            f"write_uniform_rows: weight must be [rows, dim] and rows, row_seeds, low, high [n] each; got weight "
            f"{tuple(weight.shape)}, {', '.join(map(str, shapes))}"
        )
    if rows.is_floating_point() or row_seeds.is_floating_point() or rows.dtype == torch.bool:
        raise ValueError(f"write_uniform_rows: rows and row_seeds must be integer, got {rows.dtype}, {row_seeds.dtype}")
    compiled = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64)
    if compiled and (weight.shape[1] < 2 or weight.stride(1) == 1) and native_loops() is not None:
        seeds, at, lo, hi = (t.contiguous() for t in (row_seeds.long(), rows.long(), low.double(), high.double()))
        write_rows(weight, at, seeds, lo, hi)  # op shardrec::write_uniform_rows: in place, no temporary
        return
    fresh = uniform_rows(row_seeds, weight.shape[1], low.double(), high.double(), weight.dtype)
    weight.index_copy_(0, rows.to(weight.device, torch.int64), fresh.to(weight.device))


def is_uniform(config: BaseEmbeddingConfig) -> bool:
    """Whether the table's init is the (block-evaluable) default uniform one."""
    return config.init_fn is None or isinstance(config.init_fn, UniformInit)


def init_block(config: BaseEmbeddingConfig, seed: int, out: Tensor, r0: int = 0, c0: int = 0) -> None:
    """Fill ``out [n, m]`` with rows ``[r0, r0 + n)`` x columns ``[c0, c0 + m)`` of table ``config``'s init.

    Uniform init: row ``r``'s seed is ``mix64(r) + seed``, element ``(r, c)`` is
    :func:`unit_uniform` of it scaled to the table's range, computed a block of rows at a
    time (no full-size temporary) on ``out``'s device when it is CUDA, else on CPU.
    Custom ``init_fn``: called on ``out`` with torch's RNG seeded from (seed, r0, c0) inside
    a forked RNG (equal to the whole table's block only when ``out`` is the whole table).
    """
    if out.device.type == "meta" or out.numel() == 0:
        return
    rows, cols = out.shape
    with torch.no_grad():
        if not is_uniform(config):
            _custom(config, seed, out, r0, c0)
            return
        low, high = config.init_range()
        if out.device.type == "cuda":
            _init_torch(seed, low, high, out, r0, c0)
        else:  # CPU (and MPS, which has no float64): numpy's passes, then copied
            _uniform_cpu((r0, seed), c0, (low, high), out, via_float32=True)


def _init_torch(seed: int, low: float, high: float, out: Tensor, r0: int, c0: int) -> None:
    """:func:`init_block`'s uniform rows as tensor ops on ``out``'s device (CUDA; on CPU the tests' twin)."""
    rows, cols = out.shape
    step = max(1, (_BLOCK_CUDA if out.is_cuda else _BLOCK_CPU) // cols)
    shape = (min(step, rows), cols)
    z = torch.empty(shape, dtype=torch.int64, device=out.device)
    tmp, unit = torch.empty_like(z), torch.empty(shape, dtype=torch.float64, device=out.device)
    col = _columns(c0, cols, out.device)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        u = _unit(_row_seeds(r0 + start, n, seed, out.device), col, z[:n], tmp[:n], unit[:n])
        u.mul_(high - low).add_(low)
        out[start : start + n] = u if out.dtype == torch.float32 else u.float()  # fp32 rounding first


def _row_seeds(r0: int, n: int, seed: int, device: torch.device) -> Tensor:
    """Seeds of rows ``[r0, r0 + n)`` of a table of seed ``seed``: ``mix64(row) + seed``."""
    return mix64(torch.arange(r0, r0 + n, device=device, dtype=torch.int64)) + seed


def _columns(c0: int, cols: int, device: torch.device) -> Tensor:
    return torch.arange(c0, c0 + cols, device=device, dtype=torch.int64) * GOLDEN


def mix64_(z: Tensor, scratch: Tensor) -> Tensor:
    """:func:`~lightning_shardrec.modules.dynamic.mapper.mix64` in place on int64 ``z`` (``scratch``: its shape)."""
    z.add_(GOLDEN)
    for shift, mult in ((30, _C1), (27, _C2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=scratch)
        z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(mult)
    return z


def _unit(row_seeds: Tensor, col: Tensor, z: Tensor, tmp: Tensor, out: Tensor) -> Tensor:
    """In place (``z``, ``tmp`` int64 scratch): ``out = shr(mix64(row_seeds[:, None] + col), 11) * 2**-53``."""
    mix64_(torch.add(row_seeds[:, None], col, out=z), tmp)
    torch.bitwise_right_shift(z, 11, out=tmp)
    out.copy_(tmp.bitwise_and_((1 << 53) - 1))
    return out.mul_(2.0**-53)


def _custom(config: BaseEmbeddingConfig, seed: int, out: Tensor, r0: int, c0: int) -> None:
    if (r0, c0) != (0, 0):
        mixed = mix64(torch.tensor([seed, r0, c0], dtype=torch.int64))
        seed = int(mix64(mixed[0] ^ mix64(mixed[1] + mixed[2])))
    devices = [out.device.index or 0] if out.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        config.init_fn(out)  # type: ignore[misc]  # set in __post_init__


class SeededTables:
    """A collection's table seeds (mixed into EBC and EC): one per table, drawn at construction."""

    _init_seeds: dict[str, int]

    def _draw_seeds(self, tables: Sequence[BaseEmbeddingConfig]) -> None:
        self._init_seeds = table_seeds([t.name for t in tables], self)

    def init_seed(self, table: str) -> int | None:
        """The seed table ``table``'s rows are drawn from (None: a collection unpickled from before seeds)."""
        return getattr(self, "_init_seeds", {}).get(table)

    def _init_table(self, config: BaseEmbeddingConfig, weight: Tensor) -> None:
        init_block(config, self._init_seeds[config.name], weight)
