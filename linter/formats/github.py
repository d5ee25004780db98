"""GitHub Actions workflow commands: one ``::error``/``::warning``/``::notice`` annotation per finding."""

from __future__ import annotations

from linter.finding import Finding
from linter.formats.summary import summary
from linter.runner import LintReport

_COMMANDS = {"error": "error", "warning": "warning", "info": "notice"}


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(f: Finding) -> str:
    props = [f"file={_property(f.path)}", f"line={f.line or 1}"]
    if f.column:
        props.append(f"col={f.column}")
    where = "" if f.location.startswith("line ") else " " + f.location
    props.append(f"title={_property(f.code + where)}")
    return f"::{_COMMANDS[f.severity]} {','.join(props)}::{_data(f.code + ': ' + f.message)}"


def render(report: LintReport, statistics_table: bool = False, color: bool = False) -> str:
    lines = [annotation(f) for f in report.findings]
    s = summary(report)
    if s["hit_rate"] is not None:
        lines.append(
            f"::notice title=prefixgate lint::{s['requests']} requests; prefix-cache hit rate "
            f"{100 * s['hit_rate']:.1f}% now, {100 * s['hit_rate_after_fixes']:.1f}% after fixes"
        )
    return "\n".join(lines) + "\n" if lines else ""
