"""Run TorchRec's own public-API test files against this library, renamed (issue 43).

The files come from a local mirror of ``pytorch/torchrec`` (default: the snapshot ``a48cef79``), are written
to a scratch folder with the module name ``torchrec`` replaced by ``lightning_shardrec`` (nothing else), and run
with pytest in a child process; the counts per file (passed, skipped, failed, errors, collection errors) are
printed as a table, and ``--json PATH`` writes them. TorchRec's ``schema/utils.py`` (the stable-API checker the
schema tests import; it is test tooling, not a library module) is written beside the tests as
``_torchrec_schema_utils.py`` and their import of it points there.

Usage (from the repository root)::

    PYTHONPATH=$PWD nice python benchmarks/torchrec_api_tests.py [--mirror DIR] [--rev REV] [-k EXPR] [--file F]

The mirror is a bare git directory (``git --git-dir DIR show REV:path``), e.g. from ``fetch github:pytorch/torchrec``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_MIRROR = "/work/.mirror/pytorch+torchrec/repo"
DEFAULT_REV = "a48cef79"

#: TorchRec's test files for its public API that run on CPU (issue 43: 19 files, then 5 more in session 16)
FILES: tuple[str, ...] = (
    "torchrec/schema/api_tests/test_embedding_config_schema.py",
    "torchrec/schema/api_tests/test_embedding_module_schema.py",
    "torchrec/schema/api_tests/test_inference_schema.py",
    "torchrec/schema/api_tests/test_jagged_tensor_schema.py",
    "torchrec/schema/api_tests/test_model_parallel_schema.py",
    "torchrec/schema/api_tests/test_optimizer_schema.py",
    "torchrec/schema/api_tests/test_planner_schema.py",
    "torchrec/distributed/planner/tests/test_types.py",
    "torchrec/distributed/tests/test_sharding_plan.py",
    "torchrec/distributed/tests/test_utils.py",
    "torchrec/distributed/tests/test_fx_jit.py",
    "torchrec/distributed/tests/test_awaitable.py",
    "torchrec/sparse/tests/test_jagged_tensor.py",
    "torchrec/sparse/tests/test_keyed_jagged_tensor.py",
    "torchrec/sparse/tests/test_keyed_tensor.py",
    "torchrec/modules/tests/test_embedding_modules.py",
    "torchrec/quant/tests/test_embedding_modules.py",
    "torchrec/optim/tests/test_keyed.py",
    "torchrec/fx/tests/test_tracer.py",
    "torchrec/distributed/tests/test_lazy_awaitable.py",
    "torchrec/modules/tests/test_mlp.py",
    "torchrec/modules/tests/test_activation.py",
    "torchrec/modules/tests/test_regroup.py",
    "torchrec/datasets/tests/test_random.py",
)
SCHEMA_UTILS = "torchrec/schema/utils.py"
_SCHEMA_IMPORT = "lightning_shardrec.schema.utils"
_SIDE_MODULE = "_torchrec_schema_utils"


@dataclass
class FileCounts:
    """One test file's outcome: counts of its test cases, and why collection failed when it did."""

    file: str
    passed: int = 0
    skipped: int = 0
    failed: int = 0
    errors: int = 0
    collection_error: str = ""

    @property
    def total(self) -> int:
        return self.passed + self.skipped + self.failed + self.errors


def rename(text: str) -> str:
    """The outside checker's rewrite: the module name ``torchrec`` becomes ``lightning_shardrec``."""
    return re.sub(r"\btorchrec\b", "lightning_shardrec", text)


def git_show(mirror: str, rev: str, path: str) -> str:
    out = subprocess.run(
        ["git", "--git-dir", mirror, "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    )
    return out.stdout


def write_tests(mirror: str, rev: str, files: tuple[str, ...], dest: Path) -> list[Path]:
    """Write the renamed files (flat, prefixed by their folder so names stay unique) and the side checker."""
    (dest / f"{_SIDE_MODULE}.py").write_text(git_show(mirror, rev, SCHEMA_UTILS))
    written = []
    for name in files:
        text = rename(git_show(mirror, rev, name)).replace(_SCHEMA_IMPORT, _SIDE_MODULE)
        flat = dest / name.removeprefix("torchrec/").replace("/", "__")
        flat.write_text(text)
        written.append(flat)
    return written


def _last_error_line(case: ET.Element) -> str:
    error = case.find("error")
    if error is None:
        return ""
    lines = [line[1:].strip() for line in (error.text or "").splitlines() if line.startswith("E ")]
    return (lines[-1] if lines else error.get("message", ""))[:300]


def parse_junit(xml_path: Path, written: list[Path], files: tuple[str, ...]) -> list[FileCounts]:
    by_stem = {p.stem: FileCounts(f) for p, f in zip(written, files, strict=True)}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        stem = classname.split(".")[0] if classname else case.get("name", "")
        counts = by_stem.get(stem)
        if counts is None:
            continue
        tags = {child.tag for child in case}
        if not case.get("classname"):  # a collection error is reported as a nameless case
            counts.collection_error = _last_error_line(case)
        elif "skipped" in tags:
            counts.skipped += 1
        elif "failure" in tags:
            counts.failed += 1
        elif "error" in tags:
            counts.errors += 1
        else:
            counts.passed += 1
    return list(by_stem.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", default=DEFAULT_MIRROR)
    parser.add_argument("--rev", default=DEFAULT_REV)
    parser.add_argument("--file", action="append", help="run only these files (paths as in FILES)")
    parser.add_argument("-k", default="", help="pytest -k expression")
    parser.add_argument("--json", help="write the per-file counts here")
    parser.add_argument("--keep", help="write the renamed files here (kept) instead of a scratch folder")
    parser.add_argument("--show-failures", action="store_true", help="print pytest's short summary")
    args = parser.parse_args()
    files = tuple(args.file) if args.file else FILES
    with tempfile.TemporaryDirectory() as scratch:
        dest = Path(args.keep or scratch)
        dest.mkdir(parents=True, exist_ok=True)
        written = write_tests(args.mirror, args.rev, files, dest)
        xml_path = dest / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml_path}",
            "--rootdir",
            str(dest),
            "-o",
            "junit_family=xunit1",
            "--continue-on-collection-errors",
            *map(str, written),
        ]
        if args.k:
            cmd += ["-k", args.k]
        if args.show_failures:
            cmd += ["-rfE", "--tb=line"]
        proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
        if args.show_failures:
            print(proc.stdout[-20000:])
        counts = parse_junit(xml_path, written, files)
    print(f"{'file':<58} {'pass':>5} {'skip':>5} {'fail':>5} {'err':>4}  import")
    for c in counts:
        short = c.file.removeprefix("torchrec/")
        print(f"{short:<58} {c.passed:>5} {c.skipped:>5} {c.failed:>5} {c.errors:>4}  {c.collection_error[:90]}")
    total = FileCounts(
        "total", *(sum(getattr(c, f) for c in counts) for f in ("passed", "skipped", "failed", "errors"))
    )
    stopped = [c for c in counts if c.collection_error]
    print(
        f"{'total':<58} {total.passed:>5} {total.skipped:>5} {total.failed:>5} {total.errors:>4}  "
        f"{len(stopped)} files stop at import"
    )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in counts], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
