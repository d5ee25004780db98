"""The human format: findings grouped by file, then the hit-rate table (ANSI colours only on a TTY)."""

from __future__ import annotations

from linter.formats.summary import per_rule_losses, statistics, summary
from linter.gateway_log import render_text
from linter.runner import LintReport

_COLORS = {"error": "\033[31m", "warning": "\033[33m", "info": "\033[36m", "path": "\033[1m", "dim": "\033[2m"}
_RESET = "\033[0m"


def _paint(text: str, style: str, color: bool) -> str:
    return f"{_COLORS[style]}{text}{_RESET}" if color else text


def _pct(rate: float) -> str:
    return f"{100 * rate:5.1f}%"


def _findings(report: LintReport, color: bool) -> list[str]:
    lines: list[str] = []
    current = None
    for f in report.findings:
        if f.path != current:
            if current is not None:
                lines.append("")
            lines.append(_paint(f.path, "path", color))
            current = f.path
        where = f"{f.line or 0}:{f.column or 0}"
        lost = f"  (~{f.tokens_lost} tokens lost)" if f.tokens_lost else ""
        severity = _paint(f"{f.severity:<7}", f.severity, color)
        loc = _paint(f"[{f.location}]", "dim", color) if f.location and not f.location.startswith("line ") else ""
        lines.append(f"  {where:>8}  {severity}  {f.code}  {f.message} {loc}{lost}".rstrip())
    return lines


def _table(report: LintReport) -> list[str]:
    est = report.estimate
    if est is None:
        return []
    capacity = f"{est.capacity_blocks} blocks" if est.capacity_blocks else "unbounded"
    lines = [
        "",
        f"Prefix-cache hit rate: {est.requests} requests, {est.prompt_tokens} prompt tokens "
        f"(block size {est.block_size}, cache {capacity}, {est.tokenizer} tokenizer)",
        f"  {'scenario':<22} {'hit rate':>8} {'cached tokens':>14} {'gain':>10}",
        f"  {'now':<22} {_pct(est.hit_rate):>8} {est.cached_tokens:>14} {'':>10}",
    ]
    gains = {gain.code: gain for gain in est.per_rule}
    for code, lost in per_rule_losses(report).items():
        gain = gains.get(code)
        count, unrepaired = report.unrepaired.get(code, (0, 0))
        notes = []
        if report.gained_elsewhere.get(code):
            notes.append(f"{report.gained_elsewhere[code]:+} on requests without a finding")
        if count:
            notes.append(f"the fix does not repair {count} finding(s) losing {unrepaired} tokens")
        if gain is not None and gain.applies and gain.tokens_gained == 0 and not count:
            notes.append("the fix applies, but no request of this log reuses what it changes")
        note = f"  ({'; '.join(notes)})" if notes else ""
        if gain is not None and gain.applies:
            lines.append(
                f"  {code + ' fixed':<22} {_pct(gain.hit_rate_after):>8} {gain.cached_tokens_after:>14} {gain.tokens_gained:>+10}{note}"
            )
        else:
            why = "fix does not apply to these findings" if gain is not None else "no automatic fix"
            lines.append(f"  {code:<22} {why}; its findings lose {lost} tokens")
    total_gain = est.cached_tokens_after_fixes - est.cached_tokens
    if any(gain.applies for gain in est.per_rule):
        lines.append(f"  {'all fixes':<22} {_pct(est.hit_rate_after_fixes):>8} {est.cached_tokens_after_fixes:>14} {total_gain:>+10}")
    elif per_rule_losses(report):
        lines.append(f"  {'all fixes':<22} no automatic fix applies to these findings")
    if est.segment_reuse_tokens:
        lines.append(f"  {'segment reuse':<22} {_pct(est.hit_rate_with_segment_reuse):>8} "
                     f"{est.cached_tokens + est.segment_reuse_tokens:>14} {est.segment_reuse_tokens:>+10}"
                     "  (documents that move between requests; engine opt-in, see docs/prompt_modules.md)")
    return lines


def render(report: LintReport, statistics_table: bool = False, color: bool = False) -> str:
    lines = _findings(report, color)
    s = summary(report)
    if lines:
        lines.append("")
    counts = ", ".join(f"{n} {sev}" for sev, n in s["by_severity"].items() if n)
    if s["findings"]:
        lines.append(f"Found {s['findings']} finding(s) ({counts}) in {report.files} file(s).")
    else:
        lines.append(f"No findings in {report.files} file(s).")
    if report.baselined:
        lines.append(f"{report.baselined} finding(s) accepted by the baseline are not shown.")
    for problem in report.problems:
        lines.append(f"skipped {problem.path}:{problem.line}: {problem.message}")
    if statistics_table:
        lines.append("")
        lines.append(f"  {'count':>5}  {'code':<6} {'tokens lost':>11}  name")
        for row in statistics(report):
            lines.append(f"  {row['count']:>5}  {row['code']:<6} {row['tokens_lost']:>11}  {row['name']}")
    lines.extend(_table(report))
    if report.gateway_log is not None:
        lines.append(render_text(report.gateway_log).rstrip("\n"))
    return "\n".join(lines) + "\n"
