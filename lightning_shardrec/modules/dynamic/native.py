"""Compiled CPU loops (``native.c``) of dynamic tables, built on first use with the system C compiler.

A few loops dominate what dynamic tables cost on CPU, and tensor ops do each in many
passes over large temporaries or many small ops: locating raw ids in their buckets in
training and in serving (a dozen passes over ``[ids, slots per bucket]``; one C pass
stops at the matching slot, ~5x faster for an e2e batch on one core), placing admitted
ids in their buckets (some 30 ops over ``[buckets, slots]``) and writing fresh rows'
init into a table's rows (2-3.5x faster than numpy's rows and a copy).
They are ``torch.library`` custom ops (:mod:`.ops`: schemas, fake implementations,
checked arguments); this module builds and loads the library behind them.

Only a dynamic table (training, or its serving id map) calls :func:`native_loops`: static
tables never compile or load anything (their init is numpy's, :mod:`~lightning_shardrec.
modules.table_init`). The source is plain C on raw buffers (no torch headers), so it builds in
0.15-0.5 s, where torch's C++ extension machinery takes 25-100 s (torch headers, ninja) for
one trivial op (``benchmarks/native_loops_bench.py``). The shared library is kept in the user
cache directory (else a per-user directory under the system's temporary directory), keyed by
the source, compiler and machine, and loaded with ctypes. Concurrent ranks build into private
temporary files and rename them into place (atomic: every copy is the same), so they never
read a half-written library.

Where it cannot be used (no C compiler, ``LIGHTNING_SHARDREC_NATIVE=0``, tensors not on
the CPU) each caller runs its tensor-op twin instead, with the same results bit for bit
(the tests compare the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_shardrec.user_cache import user_cache_dir

NATIVE_ENV = "LIGHTNING_SHARDREC_NATIVE"
SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-shared", "-fPIC"]  # no FMA: the same roundings as torch


@dataclass(frozen=True)
class NativeLoops:
    """The library's functions (argument lists as in ``native.c``)."""

    locate: ctypes._CFuncPtr  # type: ignore[name-defined]
    place: ctypes._CFuncPtr  # type: ignore[name-defined]
    serve: ctypes._CFuncPtr  # type: ignore[name-defined]
    uniform_rows: ctypes._CFuncPtr  # type: ignore[name-defined]


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _build(cc: str, source: bytes, out: Path) -> None:
    """Compile ``source`` into shared library ``out`` (written beside it, then renamed: ranks may race)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / SOURCE.name, Path(tmp) / out.name
        src.write_bytes(source)
        cmd = [cc, *FLAGS, str(src), "-o", str(lib)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, out)


def _load(path: Path) -> NativeLoops:
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    locate, place = lib.shardrec_locate, lib.shardrec_place
    serve, uniform = lib.shardrec_serve, lib.shardrec_uniform_rows
    locate.restype, place.restype, serve.restype, uniform.restype = i64, i64, None, None
    locate.argtypes = [i64, *[ptr] * 7, i64, *[ptr] * 3, i64, *[ptr] * 2]
    place.argtypes = [i64, *[ptr] * 4, i64, i64, i64, *[ptr] * 6]
    serve.argtypes = [i64, ptr, i64, i64, ptr, ptr, i64, ptr]
    uniform.argtypes = [i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64]
    return NativeLoops(locate, place, serve, uniform)


def _cache_dirs() -> list[Path]:
    """Where the library may live, in order: the user cache, then a per-user temporary directory."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [user_cache_dir() / "native", Path(tempfile.gettempdir()) / f"lightning_shardrec-{uid}" / "native"]


def _private(folder: Path) -> None:
    """Make ``folder``'s parent (under the shared temporary directory) ours alone, or raise OSError:
    a library loaded from there must not be one another user put there."""
    folder.parent.mkdir(mode=0o700, exist_ok=True)
    info = folder.parent.stat()
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        raise PermissionError(f"{folder.parent} is not this user's alone (owner {info.st_uid}, mode {info.st_mode:o})")


def _build_or_load(cc: str) -> NativeLoops:
    """Load the cached library, building it first where it is missing; the first cache directory that works."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), platform.machine().encode(), *map(str.encode, FLAGS)]))
    name = f"native-{key.hexdigest()[:16]}.so"
    errors = []
    for i, folder in enumerate(_cache_dirs()):
        out = folder / name
        try:
            if i:
                _private(folder)
            if not out.exists():
                _build(cc, source, out)
            return _load(out)
        except OSError as e:  # not writable, or not loadable from there (noexec): the next one
            errors.append(f"{folder}: {e}")
    raise OSError("no usable cache directory for the compiled loops: " + "; ".join(errors))


@functools.cache
@torch.compiler.disable  # under torch.compile: one graph break, the cached result (no tracing into the build)
def native_loops() -> NativeLoops | None:
    """The compiled loops of dynamic tables, built if needed; None (after one warning) where they cannot be."""
    if os.environ.get(NATIVE_ENV, "1").lower() in ("0", "off", "false", "no"):
        return None
    cc = _compiler()
    if cc is None:
        warnings.warn(
            "lightning_shardrec: a dynamic table (or its serving id map) is in use, but no C compiler was found "
            "(looked for $CC, cc, gcc, clang), so its id mapping and fresh rows run as tensor ops, several times "
            "slower on CPU (static tables are not affected); install one (e.g. gcc) to build the compiled loops, "
            f"or set {NATIVE_ENV}=0 to silence this",
            stacklevel=2,
        )
        return None
    try:
        return _build_or_load(cc)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"lightning_shardrec: building the compiled loops failed ({e}); dynamic tables' id mapping and fresh "
            f"rows run as tensor ops, several times slower on CPU (static tables are not affected; set "
            f"{NATIVE_ENV}=0 to silence this)",
            stacklevel=2,
        )
        return None
