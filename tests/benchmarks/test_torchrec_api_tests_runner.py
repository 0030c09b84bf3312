"""``benchmarks/torchrec_api_tests.py``: the rename TorchRec's test files get and the per-file counts it reads
from pytest's junit XML (the run itself needs a TorchRec mirror; it is in docs/migrating.md)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from torchrec_api_tests import FileCounts, parse_junit, rename  # noqa: E402


def test_rename_touches_the_module_name_only() -> None:
    src = "from torchrec.sparse import x\nimport torchrec\ntorchrec_logger = 1  # torchrec's\n"
    assert rename(src) == (
        "from lightning_shardrec.sparse import x\nimport lightning_shardrec\n"
        "torchrec_logger = 1  # lightning_shardrec's\n"
    )


def test_junit_cases_are_counted_per_file_with_the_import_error(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="a__t.TestX" name="test_ok"/>'
        '<testcase classname="a__t.TestX" name="test_skip"><skipped message="cuda"/></testcase>'
        '<testcase classname="a__t.TestX" name="test_bad"><failure message="boom"/></testcase>'
        '<testcase classname="a__t.TestX" name="test_err"><error message="setup"/></testcase>'
        '<testcase classname="" name="b__t"><error message="collection failure">'
        "Traceback\nE   ImportError: cannot import name 'Y'\n</error></testcase>"
        "</testsuite></testsuites>"
    )
    counts = parse_junit(xml, [tmp_path / "a__t.py", tmp_path / "b__t.py"], ("torchrec/a/t.py", "torchrec/b/t.py"))
    assert counts == [
        FileCounts("torchrec/a/t.py", passed=1, skipped=1, failed=1, errors=1),
        FileCounts("torchrec/b/t.py", collection_error="ImportError: cannot import name 'Y'"),
    ]
