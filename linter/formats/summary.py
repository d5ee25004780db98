"""The numbers every format reports: the run summary and per-rule statistics."""

from __future__ import annotations

from collections import Counter
from typing import Any

from linter.finding import SEVERITIES
from linter.registry import all_rules
from linter.runner import LintReport


def summary(report: LintReport) -> dict[str, Any]:
    """Requests, prompt tokens, hit rate now and after fixes (None without requests), counts."""
    est = report.estimate
    by_severity = Counter(f.severity for f in report.findings)
    return {
        "files": report.files,
        "findings": len(report.findings),
        "by_severity": {s: by_severity.get(s, 0) for s in reversed(SEVERITIES)},
        "baselined": report.baselined,
        "requests": est.requests if est else 0,
        "prompt_tokens": est.prompt_tokens if est else 0,
        "cached_tokens": est.cached_tokens if est else 0,
        "hit_rate": round(est.hit_rate, 6) if est else None,
        "cached_tokens_after_fixes": est.cached_tokens_after_fixes if est else 0,
        "hit_rate_after_fixes": round(est.hit_rate_after_fixes, 6) if est else None,
        "segment_reuse_tokens": est.segment_reuse_tokens if est else 0,
        "hit_rate_with_segment_reuse": round(est.hit_rate_with_segment_reuse, 6) if est else None,
        "per_rule": _per_rule(report),
        "tokenizer": est.tokenizer if est else None,
        "block_size": est.block_size if est else None,
        "capacity_blocks": est.capacity_blocks if est else None,
    }


def per_rule_losses(report: LintReport) -> dict[str, int]:
    """Tokens lost summed per code of the findings from request logs (codes sorted)."""
    lost: dict[str, int] = {}
    for f in report.findings:
        if not f.location.startswith("line "):
            lost[f.code] = lost.get(f.code, 0) + (f.tokens_lost or 0)
    return dict(sorted(lost.items()))


def _per_rule(report: LintReport) -> list[dict[str, Any]]:
    """Each code found in the logs: its fix's replay, or why there is none (never a bare 0)."""
    if report.estimate is None:
        return []
    gains = {g.code: g for g in report.estimate.per_rule}
    rows: list[dict[str, Any]] = []
    for code, lost in per_rule_losses(report).items():
        gain = gains.get(code)
        row: dict[str, Any] = {"code": code, "tokens_lost": lost}
        count, unrepaired_lost = report.unrepaired.get(code, (0, 0))
        if gain is not None and gain.applies:
            row.update(hit_rate_after=round(gain.hit_rate_after, 6), tokens_gained=gain.tokens_gained, fix="applied")
        else:
            row.update(hit_rate_after=None, tokens_gained=None, fix="does not apply" if gain is not None else "none")
        if gain is not None:
            row["not_repaired"] = {"findings": count, "tokens_lost": unrepaired_lost}
            row["tokens_gained_without_finding"] = report.gained_elsewhere.get(code, 0)
        rows.append(row)
    return rows


def statistics(report: LintReport) -> list[dict[str, Any]]:
    """One row per code that has findings: code, name, severity, count, tokens lost (sorted by count)."""
    rules = all_rules()
    counts = Counter(f.code for f in report.findings)
    lost: Counter[str] = Counter()
    for f in report.findings:
        lost[f.code] += f.tokens_lost or 0
    rows = [
        {"code": code, "name": rules[code].name, "severity": rules[code].severity, "count": n, "tokens_lost": lost[code]}
        for code, n in counts.items()
    ]
    return sorted(rows, key=lambda r: (-r["count"], r["code"]))
