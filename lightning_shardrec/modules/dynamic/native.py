"""Compiled CPU loops (``native.c``) of dynamic tables, built with the package, loaded with ctypes.

A few loops dominate what dynamic tables cost on CPU, and tensor ops do each in many
passes over large temporaries or many small ops: locating raw ids in their buckets in
training and in serving (a dozen passes over ``[ids, slots per bucket]``; one C pass
stops at the matching slot, ~5x faster for an e2e batch on one core), placing admitted
ids in their buckets (some 30 ops over ``[buckets, slots]``) and writing fresh rows'
init into a table's rows (2-3.5x faster than numpy's rows and a copy).
They are ``torch.library`` custom ops (:mod:`.ops`: schemas, fake implementations,
checked arguments); this module loads the library behind them.

The library is built when the package is (``setup.py``: ``pip install``/``pip wheel``, or
``python setup.py build_ext --inplace`` in a checkout) and sits beside this file as
``_loops.<platform suffix>``; nothing is compiled at run time, so a container without a C
compiler runs the same loops. The source is plain C on raw buffers (no Python or torch
headers): it builds in 0.15-0.5 s, where torch's C++ extension machinery takes 25-100 s for one
trivial op (``benchmarks/native_loops_bench.py``).

Only a dynamic table (training, or its serving id map) calls :func:`native_loops`: static
tables never load anything (their init is numpy's, :mod:`~lightning_shardrec.modules.table_init`).
Where the library cannot be used (the package was installed without it, ``LIGHTNING_SHARDREC_NATIVE=0``,
tensors not on the CPU) each caller runs its tensor-op twin instead, with the same results bit
for bit (the tests compare the two).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_shardrec import native_library
from lightning_shardrec.native_library import NATIVE_ENV

SOURCE = Path(__file__).with_name("native.c")
LIBRARY_NAME = "_loops"


@dataclass(frozen=True)
class NativeLoops:
    """The library's functions (argument lists as in ``native.c``)."""

    locate: ctypes._CFuncPtr  # type: ignore[name-defined]
    place: ctypes._CFuncPtr  # type: ignore[name-defined]
    serve: ctypes._CFuncPtr  # type: ignore[name-defined]
    uniform_rows: ctypes._CFuncPtr  # type: ignore[name-defined]


def library_path(folder: Path = SOURCE.parent) -> Path | None:
    """The built library in ``folder`` (``_loops`` with this interpreter's extension suffix), or None."""
    return native_library.library_path(folder, LIBRARY_NAME)


def source_key() -> str:
    """What ``setup.py`` builds into the library: the first 16 hex digits of ``native.c``'s sha256."""
    return native_library.source_key(SOURCE)


def load(path: Path) -> NativeLoops:
    """The loops of the library at ``path``, their argument types declared; OSError where it was built from
    another ``native.c`` than the one beside this file (a stale build: its functions may take other arguments)."""
    lib = native_library.open_library(path, "shardrec_source", SOURCE, source_key())
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    locate, place = lib.shardrec_locate, lib.shardrec_place
    serve, uniform = lib.shardrec_serve, lib.shardrec_uniform_rows
    locate.restype, place.restype, serve.restype, uniform.restype = i64, i64, None, i64
    locate.argtypes = [i64, ptr, ptr, i64, *[ptr] * 5, i64, *[ptr] * 3, i64, *[ptr] * 2]
    place.argtypes = [i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, *[ptr] * 6]
    serve.argtypes = [i64, ptr, i64, i64, ptr, ptr, i64, ptr]
    uniform.argtypes = [i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64]
    return NativeLoops(locate, place, serve, uniform)


@functools.cache
@torch.compiler.disable  # under torch.compile: one graph break, the cached result (no tracing into the load)
def native_loops() -> NativeLoops | None:
    """The compiled loops of dynamic tables; None (after one warning) where the package has none."""
    return native_library.load_or_warn(
        load,
        library_path(),
        "lightning_shardrec: a dynamic table (or its serving id map) is in use, but the package was installed "
        f"without its compiled loops (no {LIBRARY_NAME}.* beside {SOURCE.name}), so its id mapping and fresh rows "
        "run as tensor ops, several times slower on CPU (static tables are not affected); install a wheel, or "
        "build them where a C compiler is (`pip install .`, or `python setup.py build_ext --inplace` in a "
        f"checkout), or set {NATIVE_ENV}=0 to silence this",
        lambda path, e: (
            f"lightning_shardrec: loading the compiled loops {path} failed ({e}); dynamic tables' id mapping and "
            f"fresh rows run as tensor ops, several times slower on CPU (static tables are not affected; set "
            f"{NATIVE_ENV}=0 to silence this)"
        ),
    )
