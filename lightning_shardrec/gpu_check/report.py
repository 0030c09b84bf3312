"""The check's results: one :class:`Check` per line of the report, written as JSON and markdown."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    INFO = "info"  # a figure, nothing to pass
    NOT_CHECKED = "not checked"  # named, with the reason (e.g. needs several GPUs)


@dataclass
class Check:
    """One result: ``section`` (exactness, syncs, speed, memory, not checked), ``name``, a
    ``status``, a one-line ``detail`` and the ``figures`` behind it."""

    section: str
    name: str
    status: Status
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """Every check of one run, and where it ran (``mode``: ``"cuda"`` or ``"cpu"``)."""

    mode: str
    device: str
    environment: dict[str, str]
    checks: list[Check] = field(default_factory=list)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        mark = {Status.PASS: "ok  ", Status.FAIL: "FAIL", Status.INFO: "info", Status.NOT_CHECKED: "n/c "}
        print(f"  {mark[check.status]} {check.section}: {check.name}: {check.detail}", flush=True)
        return check

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def write(self, out: Path) -> tuple[Path, Path]:
        """``report.json`` and ``report.md`` in ``out`` (made if needed)."""
        out.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        for c in data["checks"]:
            c["status"] = c["status"].value
        data["failed"] = len(self.failed)
        json_path, md_path = out / "report.json", out / "report.md"
        json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        md_path.write_text(self.markdown())
        return json_path, md_path

    def markdown(self) -> str:
        lines = [
            f"# gpu-check report ({self.mode.upper()} mode)",
            "",
            f"Device: {self.device}. " + ", ".join(f"{k} {v}" for k, v in self.environment.items()) + ".",
            "",
            f"**{len(self.failed)} failed** of {len(self.checks)} checks.",
        ]
        for section in dict.fromkeys(c.section for c in self.checks):
            lines += ["", f"## {section}", "", "| check | status | detail |", "|---|---|---|"]
            for c in self.checks:
                if c.section == section:
                    detail = c.detail.replace("|", "\\|")
                    lines.append(f"| {c.name} | {c.status.value} | {detail} |")
        return "\n".join(lines) + "\n"
