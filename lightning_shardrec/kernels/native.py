"""Compiled CPU loops of the portable kernel (``native_rows.c``), built with the package, loaded with ctypes.

On one CPU core the torch kernel's training step is a dozen tensor ops, each a pass over
``[ids]`` or ``[rows touched, dim]`` with its own temporary: a sort, ``unique_consecutive``, an
``embedding_bag`` to sum gradients per row, ``index_select``/``index_copy_`` of rows and state,
and a transposed copy of the pooled output each way. The loops here do the same work in a few
passes over raw buffers: the pooled lookup written straight into ``[B, F*D]`` with each id checked
against its table, a radix sort grouping a batch's ids by row, the per-row gradient sums, and each
optimizer rule applied in place to the touched rows (``benchmarks/kernel_bench.py``).

The library is built when the package is (``setup.py``) and sits beside this file as
``_rows.<platform suffix>``; nothing is compiled at run time. Where it is missing or cannot be
loaded, or ``LIGHTNING_SHARDREC_NATIVE=0``, the kernel runs its tensor ops instead (one warning),
with the same results to within fp32 rounding (reductions run in another order); each path is
deterministic, so sharded and one-process runs on one machine agree bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec import native_library
from lightning_shardrec.native_library import NATIVE_ENV  # shared with the dynamic tables' loops

SOURCE = Path(__file__).with_name("native_rows.c")
LIBRARY_NAME = "_rows"
MAX_DIM = 1024  # native_rows.c's MAX_DIM: wider rows take the tensor ops

# native_rows.c's return codes and rule numbers
BAD_OFFSETS, NO_MEMORY, BAD_BAG_OFFSETS = -1, -3, -4
RULE_NUMBER = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3, "adamw": 4}


@dataclass(frozen=True)
class RowLoops:
    """The library's functions (argument lists as in ``native_rows.c``)."""

    bag_forward: ctypes._CFuncPtr  # type: ignore[name-defined]
    group_rows: ctypes._CFuncPtr  # type: ignore[name-defined]
    sum_rows: ctypes._CFuncPtr  # type: ignore[name-defined]
    apply_rule: ctypes._CFuncPtr  # type: ignore[name-defined]
    update_rows: ctypes._CFuncPtr  # type: ignore[name-defined]


def library_path(folder: Path = SOURCE.parent) -> Path | None:
    """The built library in ``folder`` (``_rows`` with this interpreter's extension suffix), or None."""
    return native_library.library_path(folder, LIBRARY_NAME)


def source_key() -> str:
    """What ``setup.py`` builds into the library: the first 16 hex digits of ``native_rows.c``'s sha256."""
    return native_library.source_key(SOURCE)


def load(path: Path) -> RowLoops:
    """The loops of the library at ``path``; OSError where it was built from another ``native_rows.c``."""
    lib = native_library.open_library(path, "shardrec_rows_source", SOURCE, source_key())
    i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    fwd, group, sums, rule = (
        lib.shardrec_bag_forward,
        lib.shardrec_group_rows,
        lib.shardrec_sum_rows,
        lib.shardrec_apply_rule,
    )
    fwd.restype, group.restype, sums.restype, rule.restype = i64, i64, None, i64
    fwd.argtypes = [i64, i64, ptr, i64, *[ptr] * 4, i64, i64, ptr, ptr, i64, ptr]
    group.argtypes = [i64, ptr, i64, ptr, i64, i64, i64, i64, *[ptr] * 4]
    sums.argtypes = [i64, *[ptr] * 5, i64, ptr]
    rule.argtypes = [ctypes.c_int, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, *[f64] * 7]
    update = lib.shardrec_update_rows
    update.restype = i64
    update.argtypes = [ctypes.c_int, i64, ptr, i64, *[ptr] * 5, i64, ptr, i64, ptr, i64, ptr, i64, *[f64] * 7]
    return RowLoops(fwd, group, sums, rule, update)


@functools.cache
@torch.compiler.disable  # under torch.compile: one graph break, the cached result (no tracing into the load)
def row_loops() -> RowLoops | None:
    """The portable kernel's compiled loops; None (after one warning) where the package has none."""
    return native_library.load_or_warn(
        load,
        library_path(),
        "lightning_shardrec: kernel='torch' runs on CPU, but the package was installed without its compiled "
        f"loops (no {LIBRARY_NAME}.* beside {SOURCE.name}), so its lookups and row updates run as tensor ops, "
        "about 2x slower on one core; install a wheel, or build them where a C compiler is (`pip install .`, "
        f"or `python setup.py build_ext --inplace` in a checkout), or set {NATIVE_ENV}=0 to silence this",
        lambda path, e: (
            f"lightning_shardrec: loading the compiled loops {path} failed ({e}); kernel='torch' runs its lookups "
            f"and row updates as tensor ops, about 2x slower on one core (set {NATIVE_ENV}=0 to silence this)"
        ),
    )


def loops_tag() -> str:
    """Which loops the torch kernel runs on CPU (``kernel="auto"``'s verdicts hold for one): ``loops <source
    key>``, or ``tensor ops`` (no library, or switched off). Loads nothing."""
    return "tensor ops" if native_library.switched_off() or library_path() is None else f"loops {source_key()}"


def ptr(t: Tensor | None) -> int | None:
    """A tensor's data address for ctypes (None: NULL)."""
    return None if t is None else t.data_ptr()


def takes(*tensors: Tensor | None) -> bool:
    """The loops can run on these (None: absent): CPU, fp32 or int64, unit last stride, at most MAX_DIM wide;
    never while torch.compile or export traces (they see the tensor ops, as before the loops)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.int64) or t.dim() > 2:
            return False
        if t.dim() and t.numel() and t.stride(-1) != 1:
            return False
        if t.dim() == 2 and t.shape[1] > MAX_DIM:
            return False
    return True


@dataclass(frozen=True)
class Groups:
    """A batch's ids grouped by row (``shardrec_group_rows``): ``rows [U]`` ascending, ``starts [U + 1]``,
    and per id in sorted order its gradient row's element offset ``src`` and its index ``pos``."""

    rows: Tensor
    starts: Tensor
    src: Tensor
    pos: Tensor


def group_rows(
    loops: RowLoops, ids: Tensor, num_rows: int, offsets: Tensor | None, batch: int, ldg: int, fstride: int
) -> Groups:
    """Group contiguous int64 ``ids`` (each in ``[0, num_rows)``, ``num_rows <= 2**31``) by row. ``offsets``
    (int64 ``[bags + 1]``): id ``i`` of bag ``k = f * batch + b`` reads gradient elements from
    ``b * ldg + f * fstride``; None: id ``i`` reads them from ``i * ldg``."""
    n = ids.numel()
    out = torch.empty(4, n + 1, dtype=torch.int64)
    nbags = 0 if offsets is None else offsets.numel() - 1
    rows, starts, src, pos = out.unbind(0)
    u = loops.group_rows(n, ptr(ids), num_rows, ptr(offsets), nbags, max(batch, 1), ldg, fstride,
                         ptr(rows), ptr(starts), ptr(src), ptr(pos))  # fmt: skip
    if u <= -2:
        bad = -2 - u
        raise ValueError(f"row updates: id {int(ids[bad])} (index {bad}) is outside the rows [0, {num_rows})")
    if u == BAD_OFFSETS:
        raise ValueError(f"row updates: offsets must rise from 0 to the {n} ids, got {offsets_text(offsets)}")
    if u == NO_MEMORY:
        raise MemoryError(f"row updates: no memory to sort {n} ids")
    return Groups(rows[:u], starts[: u + 1], src[:n], pos[:n])


def offsets_text(offsets: Tensor | None) -> str:
    values = [] if offsets is None else offsets.tolist()
    return str(values if len(values) <= 8 else [*values[:4], "...", *values[-4:]])


def sum_rows(loops: RowLoops, groups: Groups, grad: Tensor, weights: Tensor | None, dim: int) -> Tensor:
    """Each group's gradient rows summed in batch order (times ``weights`` per id): ``[U, dim]``."""
    u = groups.rows.numel()
    out = torch.empty(u, dim, dtype=torch.float32)
    loops.sum_rows(u, ptr(groups.starts), ptr(groups.src), ptr(groups.pos), ptr(grad), ptr(weights), dim, ptr(out))
    return out


def _rule_args(weight: Tensor, state: dict[str, Tensor], hp: Any) -> tuple[Any, ...]:
    """The table and hyper-parameter arguments of ``shardrec_apply_rule``/``shardrec_update_rows``."""
    s1 = state.get("sum", state.get("exp_avg"))
    s2 = state.get("exp_avg_sq")
    b1, b2 = hp["beta1"], hp["beta2"]
    step = float(state["step"]) if "step" in state else 0.0
    bias1, bias2 = (1 - b1**step, 1 - b2**step) if "step" in state else (1.0, 1.0)
    lds1 = 0 if s1 is None or s1.dim() < 2 else s1.stride(0)
    lds2 = 0 if s2 is None else s2.stride(0)
    return (
        ptr(weight), weight.stride(0), ptr(s1), lds1, ptr(s2), lds2,
        hp["lr"], hp["eps"], b1, b2, hp["weight_decay"], bias1, bias2,
    )  # fmt: skip


def _row_error(bad: int, rows: Tensor, weight: Tensor) -> None:
    if bad >= 0:
        raise ValueError(f"row updates: row {int(rows[bad])} is outside the table's rows [0, {weight.shape[0]})")


def apply_rule(
    loops: RowLoops, name: str, weight: Tensor, rows: Tensor, grad: Tensor, state: dict[str, Tensor], hp: Any
) -> None:
    """One step of rule ``name`` on unique ``rows`` of ``weight`` with their summed ``grad [U, D]`` (contiguous;
    the tensors checked by the caller: ``takes``)."""
    args = _rule_args(weight, state, hp)
    bad = loops.apply_rule(RULE_NUMBER[name], rows.numel(), ptr(rows), weight.shape[0], ptr(grad), grad.shape[1], *args)
    _row_error(bad, rows, weight)


def update_rows(
    loops: RowLoops,
    name: str,
    weight: Tensor,
    groups: Groups,
    grad: Tensor,
    weights: Tensor | None,
    state: dict[str, Tensor],
    hp: Any,
) -> None:
    """:func:`sum_rows` then :func:`apply_rule` in one pass, without the ``[U, D]`` sums (same results)."""
    rows = groups.rows
    bad = loops.update_rows(
        RULE_NUMBER[name], rows.numel(), ptr(rows), weight.shape[0], ptr(groups.starts), ptr(groups.src),
        ptr(groups.pos), ptr(grad), ptr(weights), weight.shape[1], *_rule_args(weight, state, hp),
    )  # fmt: skip
    _row_error(bad, rows, weight)
