"""``benchmarks/e2e_bench.py``: its arithmetic, its docs section, and a ``--quick`` run.

No timing is checked: the machines are shared and noisy. The quick run starts every
non-TorchRec variant in fresh processes (torch + Lightning imports per rank), so it is
marked slow; TorchRec needs its own venv and is left to ``make bench``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("e2e_bench", BENCH / "e2e_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("e2e_bench", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_windows_use_the_slowest_rank():
    e2e = _load()
    ranks = [
        {"batch_size": 100, "step_seconds": [0.1, 0.1, 0.1, 0.1]},
        {"batch_size": 100, "step_seconds": [0.2, 0.2, 0.1, 0.1]},
    ]
    # window 2: rank 1 takes 0.4 s then 0.2 s for 2 steps x 200 samples
    assert e2e.windows(ranks, 2) == pytest.approx([1000.0, 2000.0])
    assert e2e.whole(ranks) == pytest.approx(800 / 0.6)


def test_write_section_keeps_other_sections_machines_and_the_reading(tmp_path, monkeypatch):
    e2e = _load()
    doc = tmp_path / "b.md"
    doc.write_text(
        "# Benchmarks\n\n## Kernels\n\nk\n\n## End-to-end training\n\nintro\n\n### Other CPU (AVX2)\n\n"
        "theirs\n\nReading: theirs\n\n## Later\n\nz\n"
    )
    monkeypatch.setattr(e2e, "machine_heading", lambda: "This CPU (AVX-512)")
    e2e.write_section(doc, "## End-to-end training\n\nold figures\n")
    doc.write_text(doc.read_text().replace("old figures\n", "old figures\n\nReading: mine\n"))
    e2e.write_section(doc, "## End-to-end training\n\nnew figures\n")
    text = doc.read_text()
    assert "## Kernels\n\nk\n" in text and "## Later\n\nz\n" in text
    # the other machine's part stays beside this machine's, which is replaced (its reading kept)
    assert "### Other CPU (AVX2)\n\ntheirs\n\nReading: theirs\n" in text
    assert "### This CPU (AVX-512)\n\nnew figures\n\nReading: mine\n" in text
    assert "old figures" not in text and text.index("theirs") < text.index("new figures") < text.index("## Later")


@pytest.mark.slow
def test_e2e_bench_quick_runs_every_local_variant(tmp_path):
    plot = tmp_path / "e2e.png"
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "e2e_bench.py"),
            "--quick",
            "--variants",
            "shardrec,shardrec_pipeline,dmp_plain,ddp_sparse,kernel_floor,kernel_floor_torch",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    assert text.startswith("## End-to-end training")
    for v in ("shardrec", "dmp_plain", "ddp_sparse", "kernel_floor", "kernel_floor_torch"):
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {v} |"))
        assert "not run" not in row, row
    assert "| shardrec_pipeline |" in text  # the slot is kept
    assert "shardrec / floor (fbgemm) = " in text or "shardrec / floor (torch) = " in text
    assert "kernel_floor_torch / kernel_floor = " in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
