"""``benchmarks/serving_bench.py --quick`` runs end to end (no timings are checked)."""

from __future__ import annotations

from test_bench_smoke import run_quick


def test_serving_bench_quick(forked_python):
    text = run_quick(forked_python, "serving_bench.py")
    assert text.startswith("## Serving latency")
    for batch in (1, 64, 512):
        for case in ("eager float", "eager int8", "pt2 int8"):
            assert f"| {batch} | 1 | {case} |" in text
