"""The benchmarks' one harness: the machine, rounds of timed calls, paired ratios, and the report.

* the machine: :func:`cpu_model` (``model name``, as ``lscpu`` prints it), :func:`vector_isa`,
  :func:`machine_heading` (``### AMD EPYC (AVX-512)``: whose figures), :func:`machine` (one
  line: CPU x count, OS, Python, torch);
* rounds: :func:`seconds` of one call, :func:`rounds` (``reps`` calls, each after an optional
  ``before`` such as a barrier), :func:`paired` (variants run in turn within each round, so a
  machine's drift moves them all), :func:`ratios` of two paired series;
* a sample: :class:`Stat` (median and spread);
* the report: :func:`replace_section` / :func:`replace_machine_section` of ``docs/benchmarks.md``;
* :func:`free_port` for scripts that start their own ranks.

Scripts import it as ``from harness import ...`` (``benchmarks/`` is on ``sys.path`` when a
script runs from it).
"""

from __future__ import annotations

import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
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

    def text(self, spec: str = ".2f") -> str:
        """``median | lo..hi``, a report table's two cells."""
        return f"{self.median:{spec}} | {self.lo:{spec}}..{self.hi:{spec}}"


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rounds(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``reps`` calls of ``fn``, each after ``before()`` (e.g. a barrier: every rank starts together)."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        out.append(seconds(fn))
    return out


def ratios(values: Sequence[float], base: Sequence[float]) -> Stat:
    """Per round, ``values[i] / base[i]``: a paired ratio, immune to drift that moves both."""
    return Stat([a / b for a, b in zip(values, base, strict=True)])


def paired(variants: dict[str, Callable[[], object]], reps: int, warm: bool = True) -> dict[str, tuple[Stat, Stat]]:
    """``{name: (seconds, ratio to the first variant)}``: each round runs every variant once, in turn
    (each called once first when ``warm``)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    if warm:
        for fn in variants.values():
            fn()
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(seconds(fn))
    first = next(iter(times.values()))
    return {k: (Stat(v), ratios(v, first)) for k, v in times.items()}


def free_port() -> int:
    """A TCP port free on this host now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_models() -> list[str]:
    """``/proc/cpuinfo``'s ``model name`` of every logical CPU (empty where there is none)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return []
    return [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s ``Model name``), else what ``platform`` knows."""
    models = cpu_models()
    return models[0] if models else platform.processor() or platform.machine() or "unknown CPU"


def machine(isa: bool = True) -> str:
    """``AMD EPYC x 2 (AVX-512), Linux 6.1, Python 3.11.7, torch 2.13.0``: whose figures, in one line."""
    import torch  # noqa: PLC0415 - only for its version (the report helpers above need no torch)

    models = cpu_models()
    cpu = f"{models[0]} x {len(models)}" if models else platform.machine()
    cpu += f" ({vector_isa()})" if isa and models else ""
    system = f"{platform.system()} {platform.release()}"
    return f"{cpu}, {system}, Python {platform.python_version()}, torch {torch.__version__}"


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
    models = cpu_models()
    return f"{models[0] if models else platform.machine()} ({vector_isa()})"
