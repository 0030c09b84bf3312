"""What every benchmark reports with: a sample statistic, and its section of ``docs/benchmarks.md``."""

from __future__ import annotations

import platform
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


def replace_machine_section(path: Path, heading: str, machine: str, text: str) -> None:
    """Replace (or add) this machine's ``### {machine}`` part of the ``heading`` section by ``text``.

    Figures from other machines (their own ``###`` parts) stay side by side; a hand-written
    ``Reading:`` paragraph at the end of the old part is kept as :func:`replace_section` does.
    """
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    sub = f"### {machine}"
    body = sub + "\n\n" + text.rstrip("\n") + "\n"
    start = old.find(heading + "\n")
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + heading + "\n\n" + body)
        return
    end = old.find("\n## ", start + len(heading))
    end = len(old) if end < 0 else end + 1
    at = old.find(sub + "\n", start, end)
    if at < 0:  # a new machine: its part goes at the end of the section
        new = old[:end].rstrip("\n") + "\n\n" + body + ("\n" + old[end:] if end < len(old) else "")
    else:
        stop = old.find("\n### ", at + len(sub))
        stop = end if stop < 0 or stop >= end else stop + 1
        part = old[at:stop]
        reading = part.find("\nReading")
        if reading >= 0 and "\nReading" not in body:
            body = body.rstrip("\n") + "\n" + part[reading:].rstrip("\n") + "\n"
        new = old[:at] + body + ("\n" + old[stop:] if stop < len(old) else "")
    path.write_text(new)


def machine_heading() -> str:
    """``AMD EPYC (AVX-512)``: the CPU model and its widest vector ISA, naming a machine's figures."""
    info = Path("/proc/cpuinfo")
    model = platform.machine()
    if info.exists():
        models = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
        model = models[0] if models else model
    return f"{model} ({vector_isa()})"
