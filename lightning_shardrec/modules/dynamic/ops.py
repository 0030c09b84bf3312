"""The compiled CPU loops (:mod:`.native`) as ``torch.library`` custom ops in namespace ``shardrec``.

Each loop is an operator with a schema, its mutated arguments declared and a fake (meta)
implementation, so ``torch.compile`` and ``torch.export`` see one opaque call of known
output shapes instead of raw pointers behind autograd's back:

=================================  =====================================================  ==========================
op                                 what                                                   mutates
=================================  =====================================================  ==========================
``shardrec::locate``               raw ids -> (flat bucket, live slot or -1), hits        ``last``, ``seen``
                                   recorded (training); plus the first id outside its
                                   table's buckets (or -1)
``shardrec::place``                unique ids, sorted by bucket, take entries of their    ``held``, ``last``,
                                   buckets -> (entry or -1, entries taken over)           ``count``
``shardrec::serve``                a frozen table's raw ids -> rows (``missing``: none)   --
``shardrec::write_uniform_rows``   fresh uniform rows written into rows of a table        ``weight``
=================================  =====================================================  ==========================

The CPU kernels check every argument before anything is written: dtype, contiguity and
shapes here; the per-id index values that address memory (a table, bucket or row index, the
buckets' order) inside the loop's own pass (or a read-only pass before its first write), so
no call makes extra passes over its ids in Python. Each failure is a ``ValueError`` naming
the op, the argument, the value and what it must be. They run the library :func:`~.native.native_loops` loads on
first use (built with the package; nothing is loaded before a dynamic table or a serving id map
calls one); callers use the tensor-op twins where the package has none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.configs import MAX_SLOTS_PER_BUCKET
from lightning_shardrec.modules.dynamic.native import NativeLoops, native_loops

__all__ = ["locate", "place", "serve", "write_uniform_rows"]

# what the loops return for an index value out of range, nothing written (native.c's #defines)
LOCATE_BAD_TABLE = -2
PLACE_BAD_BUCKET, PLACE_UNSORTED = -1, -2
ROWS_OUT_OF_RANGE = -1


def _loops(op: str) -> NativeLoops:
    loops = native_loops()
    if loops is None:
        raise RuntimeError(
            f"shardrec::{op}: the compiled loops are not loaded here (the package was installed without them, "
            "they failed to load, or LIGHTNING_SHARDREC_NATIVE=0); use the tensor-op twin "
            "(lightning_shardrec.modules.dynamic.slots)"
        )
    return loops


def _vector(op: str, name: str, t: Tensor, dtype: torch.dtype = torch.int64, n: int | None = None) -> None:
    """``t`` must be a contiguous 1-D CPU tensor of ``dtype`` (and ``n`` long, if given)."""
    if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"shardrec::{op}: {name} must be a contiguous 1-D {dtype} CPU tensor, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})"
        )
    if n is not None and t.numel() != n:
        raise ValueError(f"shardrec::{op}: {name} must have {n} elements, got {t.numel()}")


def _within(op: str, name: str, t: Tensor, lo: int, hi: int) -> None:
    """Every value of ``t`` in ``[lo, hi)``."""
    if t.numel() and not (lo <= int(t.min()) and int(t.max()) < hi):
        raise ValueError(f"shardrec::{op}: {name} must lie in [{lo}, {hi}), got {int(t.min())}..{int(t.max())}")


def _width(op: str, width: int) -> None:
    if not 1 <= width <= MAX_SLOTS_PER_BUCKET:
        raise ValueError(f"shardrec::{op}: width must be in [1, {MAX_SLOTS_PER_BUCKET}], got {width}")


def _buckets(op: str, width: int, **buffers: Tensor) -> int:
    """Check ``buffers`` (int64 ``[W * width]`` each, the same length); return ``W``."""
    _width(op, width)
    sizes = {name: t.numel() for name, t in buffers.items()}
    first = next(iter(sizes.values()))
    for name, t in buffers.items():
        _vector(op, name, t, n=first)
    if first % width:
        raise ValueError(f"shardrec::{op}: {'/'.join(sizes)} have {first} entries, not a multiple of width {width}")
    return first // width


@torch.library.custom_op("shardrec::locate", mutates_args=("last", "seen"), device_types="cpu")
def locate(
    ids: Tensor,
    table: Tensor | None,
    num_buckets: Tensor,
    lo: Tensor,
    count: Tensor,
    start: Tensor,
    steps: Tensor,
    width: int,
    held: Tensor,
    last: Tensor,
    seen: Tensor,
    train: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(bucket [N], slot [N], bad [])`` of raw ``ids [N]`` of tables ``table [N]`` (None: table 0)
    over ``T`` tables' buckets (``num_buckets, lo, count, start, steps [T]``) in flat slot state
    ``held, last, seen [W * width]``. ``bad``: the first id outside its table's buckets, or -1
    (then, training, every hit recorded: ``last = steps[t]``, ``seen += 1``; else nothing)."""
    op = "locate"
    n = ids.numel()
    _vector(op, "ids", ids)
    buckets = _buckets(op, width, held=held, last=last, seen=seen)
    _vector(op, "num_buckets", num_buckets)
    tables = num_buckets.numel()
    for name, t in (("lo", lo), ("count", count), ("start", start), ("steps", steps)):
        _vector(op, name, t, n=tables)
    if table is not None:
        _vector(op, "table", table, n=n)  # its values: in the loop's own pass
    elif tables < 1:
        raise ValueError(f"shardrec::{op}: num_buckets must have at least one table, got {tables}")
    _within(op, "num_buckets", num_buckets, 1, 1 << 62)  # per table: [T], not per id
    _within(op, "count", count, 0, buckets + 1)
    _within(op, "start", start, 0, buckets + 1)
    _within(op, "start + count", start + count, 0, buckets + 1)
    bucket, slot = torch.empty_like(ids), torch.empty_like(ids)
    ptr = [t.data_ptr() for t in (num_buckets, lo, count, start, steps)]
    bad = _loops(op).locate(n, ids.data_ptr(), None if table is None else table.data_ptr(), tables, *ptr, width,
                            held.data_ptr(), last.data_ptr(), seen.data_ptr(), int(train), bucket.data_ptr(),
                            slot.data_ptr())  # fmt: skip
    if bad == LOCATE_BAD_TABLE:
        _within(op, "table", table, 0, tables)  # type: ignore[arg-type]  # raises, naming the values
    return bucket, slot, torch.tensor(bad, dtype=torch.int64)


@locate.register_fake
def _(ids, table, num_buckets, lo, count, start, steps, width, held, last, seen, train):  # type: ignore[no-untyped-def]
    return torch.empty_like(ids), torch.empty_like(ids), ids.new_empty(())


@torch.library.custom_op("shardrec::place", mutates_args=("held", "last", "count"), device_types="cpu")
def place(
    ids: Tensor, bucket: Tensor, total: Tensor, step: Tensor, width: int, lfu: bool, held: Tensor, last: Tensor,
    count: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Unique ``ids [n]`` sorted by ``bucket [n]`` (flat, in ``[0, W)``) with sightings ``total [n]``
    at ``step`` (``[1]`` shared or ``[n]``) take entries of their buckets in ``held, last, count
    [W * width]``: ``(entry [n] or -1, displaced [m]: occupied entries taken over)``."""
    op = "place"
    n = ids.numel()
    buckets = _buckets(op, width, held=held, last=last, count=count)
    _vector(op, "ids", ids)
    _vector(op, "bucket", bucket, n=n)
    _vector(op, "total", total, n=n)
    _vector(op, "step", step)
    if step.numel() not in (1, n):
        raise ValueError(f"shardrec::{op}: step must have 1 or {n} elements (one per id), got {step.numel()}")
    out, displaced, scratch = (torch.empty(n, dtype=torch.int64) for _ in range(3))
    moved = _loops(op).place(n, ids.data_ptr(), bucket.data_ptr(), buckets, total.data_ptr(), step.data_ptr(),
                             int(step.numel() > 1), width, int(lfu), held.data_ptr(), last.data_ptr(),
                             count.data_ptr(), out.data_ptr(), displaced.data_ptr(), scratch.data_ptr())  # fmt: skip
    if moved == PLACE_BAD_BUCKET:  # the loop checks the buckets' range and order before it writes
        _within(op, "bucket", bucket, 0, buckets)
    if moved == PLACE_UNSORTED:
        raise ValueError(f"shardrec::{op}: ids must come sorted by bucket, got buckets {bucket.tolist()[:8]}...")
    return out, displaced[:moved].clone()


@place.register_fake
def _(ids, bucket, total, step, width, lfu, held, last, count):  # type: ignore[no-untyped-def]
    moved = torch.library.get_ctx().new_dynamic_size()  # at most ids.numel()
    return torch.empty_like(ids), ids.new_empty(moved)


@torch.library.custom_op("shardrec::serve", mutates_args=(), device_types="cpu")
def serve(ids: Tensor, num_buckets: int, width: int, held: Tensor, live: Tensor, missing: int) -> Tensor:
    """Rows ``[N]`` of raw ``ids [N]`` in a frozen table of ``num_buckets`` buckets of ``width`` slots
    (``held [B * width]`` int64, ``live`` bool): the slot holding the id where live, else ``missing``."""
    op = "serve"
    _width(op, width)
    if num_buckets < 1:
        raise ValueError(f"shardrec::{op}: num_buckets must be at least 1, got {num_buckets}")
    _vector(op, "ids", ids)
    _vector(op, "held", held, n=num_buckets * width)
    _vector(op, "live", live, dtype=torch.bool, n=num_buckets * width)
    out = torch.empty_like(ids)
    _loops(op).serve(ids.numel(), ids.data_ptr(), num_buckets, width, held.data_ptr(), live.data_ptr(), missing,
                     out.data_ptr())  # fmt: skip
    return out


@serve.register_fake
def _(ids, num_buckets, width, held, live, missing):  # type: ignore[no-untyped-def]
    return torch.empty_like(ids)


@torch.library.custom_op("shardrec::write_uniform_rows", mutates_args=("weight",), device_types="cpu")
def write_uniform_rows(weight: Tensor, rows: Tensor, row_seeds: Tensor, low: Tensor, high: Tensor) -> None:
    """``weight[rows] = low + (high - low) * unit`` of ``row_seeds`` (:func:`~lightning_shardrec.modules.
    table_init.uniform_rows`, bit for bit), in place: ``weight [R, dim]`` float32/float64 of unit column
    stride, ``rows, row_seeds`` int64 ``[n]`` (rows in ``[0, R)``), ``low, high`` float64 ``[n]``."""
    op = "write_uniform_rows"
    n = rows.numel()
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.float64) or weight.device.type != "cpu":
        raise ValueError(
            f"shardrec::{op}: weight must be a 2-D float32 or float64 CPU tensor, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError(f"shardrec::{op}: weight's rows must be contiguous, got strides {weight.stride()}")
    _vector(op, "rows", rows)
    _vector(op, "row_seeds", row_seeds, n=n)
    _vector(op, "low", low, dtype=torch.float64, n=n)
    _vector(op, "high", high, dtype=torch.float64, n=n)
    done = _loops(op).uniform_rows(n, weight.shape[1], 0, row_seeds.data_ptr(), low.data_ptr(), high.data_ptr(),
                                   int(weight.dtype == torch.float32), weight.data_ptr(), rows.data_ptr(),
                                   weight.shape[0], weight.stride(0))  # fmt: skip
    if done == ROWS_OUT_OF_RANGE:  # the loop checks every row before it writes one
        _within(op, "rows", rows, 0, weight.shape[0])


@write_uniform_rows.register_fake
def _(weight, rows, row_seeds, low, high):  # type: ignore[no-untyped-def]
    return None
