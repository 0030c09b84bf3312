"""The package's compiled C libraries, found and opened: plain C on raw buffers, built with the package
(``setup.py``), loaded with ctypes, each beside its source as ``<name><extension suffix>``.

Two use this: the portable kernel's row loops (:mod:`lightning_shardrec.kernels.native`) and the dynamic
tables' loops (:mod:`lightning_shardrec.modules.dynamic.native`). A library records the sha256 of the source it
was built from; a stale build (its functions may take other arguments) is refused. Where none can be used, each
caller warns once and runs its tensor ops; ``LIGHTNING_SHARDREC_NATIVE=0`` switches both off.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

NATIVE_ENV = "LIGHTNING_SHARDREC_NATIVE"
T = TypeVar("T")


def switched_off() -> bool:
    """``LIGHTNING_SHARDREC_NATIVE`` says 0/off/false/no."""
    return os.environ.get(NATIVE_ENV, "1").lower() in ("0", "off", "false", "no")


def library_path(folder: Path, name: str) -> Path | None:
    """The library ``name`` built in ``folder`` (with this interpreter's extension suffix), or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def source_key(source: Path) -> str:
    """What ``setup.py`` builds into a library: the first 16 hex digits of its source's sha256."""
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def open_library(path: Path, key_symbol: str, source: Path, want: str) -> ctypes.CDLL:
    """The library at ``path``; OSError where its ``key_symbol()`` is not ``want`` (``source``'s key)."""
    lib = ctypes.CDLL(str(path))
    getattr(lib, key_symbol).restype = ctypes.c_char_p
    built = getattr(lib, key_symbol)().decode()
    if built != want:
        raise OSError(f"it was built from another {source.name} (source {built}, this one is {want}); rebuild it")
    return lib


def load_or_warn(
    load: Callable[[Path], T], path: Path | None, missing: str, failed: Callable[[Path, Exception], str]
) -> T | None:
    """``load(path)``; None after one warning (``missing`` where there is no library, ``failed(path, error)``
    where it cannot be loaded here: another machine's build, a noexec mount) or where switched off."""
    if switched_off():
        return None
    if path is None:
        warnings.warn(missing, stacklevel=3)
        return None
    try:
        return load(path)
    except (OSError, AttributeError) as e:
        warnings.warn(failed(path, e), stacklevel=3)
        return None
