"""docs/migrating.md's table of TorchRec's public modules says what importing each gives here (issue 43).

A row names a module (`` `x` ``) or the rest of a package (`` `x.*` ``: every listed module under ``x.``
without a more specific row), with the count in parentheses for groups; each of TorchRec's modules
(``TORCHREC_MODULES``) resolves to its most specific row, whose status must be what importing it gives.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import lightning_shardrec  # noqa: F401  (installs the TorchRec path finder)
from lightning_shardrec.compat.torchrec.paths import TORCHREC_MODULES
from lightning_shardrec.errors import MissingTorchRecFeatureError

DOC = Path(__file__).parents[2] / "docs" / "migrating.md"


def _rows() -> list[tuple[list[str], int | None, str]]:
    text = DOC.read_text().split("## TorchRec 1.9 public modules", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        m = re.match(r"\| (`[^|]*?`(?:, `[^|]*?`)*)(?: \((\d+)\))? \| (yes|part|no) \|", line)
        if m:
            rows.append((re.findall(r"`([^`]+)`", m.group(1)), int(m.group(2)) if m.group(2) else None, m.group(3)))
    return rows


def _status(path: str) -> str:
    try:
        module = importlib.import_module(f"lightning_shardrec.{path}")
    except MissingTorchRecFeatureError:
        return "no"
    return "part" if "__getattr__" in vars(module) else "yes"


def test_every_torchrec_module_has_a_row_with_its_status():
    rows = _rows()
    exact = {name: i for i, (names, _, _) in enumerate(rows) for name in names if not name.endswith("*")}
    groups = {name[:-1]: i for i, (names, _, _) in enumerate(rows) for name in names if name.endswith(".*")}
    counts = [0] * len(rows)
    wrong = []
    for path in sorted(TORCHREC_MODULES):
        if path in exact:
            i = exact[path]
        else:
            prefixes = [g for g in groups if path.startswith(g)]
            assert prefixes, f"no row of docs/migrating.md covers torchrec.{path}"
            i = groups[max(prefixes, key=len)]
        counts[i] += 1
        if rows[i][2] != _status(path):
            wrong.append(f"{path}: table says {rows[i][2]}, import gives {_status(path)}")
    assert not wrong, "\n".join(wrong)
    stale = [(names, n, counts[i]) for i, (names, n, _) in enumerate(rows) if n is not None and n != counts[i]]
    assert not stale, stale
