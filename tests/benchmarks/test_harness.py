"""The benchmarks' shared harness (``benchmarks/harness.py``): paired rounds and the report's sections."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402


def test_paired_runs_every_variant_once_per_round_and_divides_within_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    # a: 1, 4, 4 s; b: 2, 8, 2 s. Per round b/a = 2, 2, 0.5 (median 2); the medians' ratio would be 2 / 4
    clock = iter([0.0, 1.0, 1.0, 3.0, 3.0, 7.0, 7.0, 15.0, 15.0, 19.0, 19.0, 21.0])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    out = harness.paired({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3, warm=False)
    assert calls == ["a", "b"] * 3
    assert out["a"][0].values == [1.0, 4.0, 4.0] and out["b"][0].values == [2.0, 8.0, 2.0]
    assert out["b"][1].values == [2.0, 2.0, 0.5] and out["b"][1].median == 2.0 and out["a"][1].median == 1.0


def test_rounds_call_before_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    times = harness.rounds(lambda: seen.append("fn"), 3, before=lambda: seen.append("barrier"))
    assert seen == ["barrier", "fn"] * 3 and len(times) == 3 and all(t >= 0 for t in times)
    assert harness.Stat([3.0, 1.0, 2.0]).text(".1f") == "2.0 | 1.0..3.0"


def test_a_machine_section_replaces_only_this_machines_part_and_keeps_its_reading(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\n## Kernels\n\n### CPU A\n\nold A\n\nReading: A is fast.\n\n"
        "### CPU B\n\nold B\n\n## Next\n\nx\n"
    )
    harness.replace_machine_section(doc, "## Kernels", "CPU A", "new A\n")
    text = doc.read_text()
    assert "old A" not in text and "new A\n\nReading: A is fast." in text
    assert "### CPU B\n\nold B" in text and text.endswith("## Next\n\nx\n")
