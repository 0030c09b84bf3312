"""Helpers of the data tests: small Criteo-format files written into tmp_path."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest


def _criteo_lines(n: int, seed: int = 0) -> list[str]:
    """``n`` well-formed Criteo lines with blanks, negatives and varied hex widths."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        label = str(rng.randint(0, 1))
        dense = ["" if rng.random() < 0.2 else str(rng.randint(-3, 5000)) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        lines.append("\t".join([label, *dense, *cats]))
    return lines


def _write_criteo(path: Path, lines: list[str]) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


@pytest.fixture
def criteo_day_dir(tmp_path: Path) -> Path:
    """Terabyte layout: day_0.gz (gzip) and day_1 (plain), 300 + 200 rows."""
    d = tmp_path / "criteo"
    d.mkdir()
    _write_criteo(d / "day_0.gz", _criteo_lines(300, seed=1))
    _write_criteo(d / "day_1", _criteo_lines(200, seed=2))
    return d


@pytest.fixture
def criteo_lines():  # type: ignore[no-untyped-def]
    """``criteo_lines(n, seed=0) -> list[str]`` of well-formed lines."""
    return _criteo_lines


@pytest.fixture
def write_criteo():  # type: ignore[no-untyped-def]
    """``write_criteo(path, lines) -> path``; gzip when the name ends in ``.gz``."""
    return _write_criteo
