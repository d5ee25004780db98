"""The JSON format: ``{"findings": [...], "summary": {...}, "problems": [...]}`` (plus ``statistics``)."""

from __future__ import annotations

import json
from typing import Any

from linter.formats.summary import statistics, summary
from linter.runner import LintReport


def render(report: LintReport, statistics_table: bool = False, color: bool = False) -> str:
    out: dict[str, Any] = {
        "findings": [f.to_dict() for f in report.findings],
        "summary": summary(report),
        "problems": [{"path": p.path, "line": p.line, "message": p.message} for p in report.problems],
    }
    if report.gateway_log is not None:
        out["gateway_log"] = [s.to_dict() for s in report.gateway_log]
    if statistics_table:
        out["statistics"] = statistics(report)
    return json.dumps(out, indent=2, ensure_ascii=False) + "\n"
