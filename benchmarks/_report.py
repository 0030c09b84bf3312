"""What every benchmark reports with: a sample statistic, and its section of ``docs/benchmarks.md``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Stat:
    """Repeated measurements: median and spread (min..max)."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)


def vector_isa() -> str:
    """The widest x86 vector extension the CPU reports: ``AVX-512``, ``AVX2``, ``AVX`` or ``-``."""
    info = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if info.exists():
        for ln in info.read_text().splitlines():
            if ln.startswith("flags"):
                flags = set(ln.split(":", 1)[1].split())
                break
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return "-"


def replace_section(path: Path, heading: str, text: str) -> None:
    """Replace (or append) the section that starts with ``heading`` by ``text``.

    A hand-written ``Reading:`` paragraph at the end of the old section is kept, after
    the new figures (re-check it against them), unless ``text`` brings its own.
    """
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(heading))
        section = old[start:] if end < 0 else old[start : end + 1]
        reading = section.find("\nReading:")
        if reading >= 0 and "\nReading:" not in text and not text.startswith("Reading:"):
            text = text.rstrip("\n") + "\n" + section[reading:].rstrip("\n") + "\n"
        new = old[:start] + text + ("" if end < 0 else "\n" + old[end + 1 :])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
