"""SARIF 2.1.0 as GitHub code scanning accepts it.

One run; ``tool.driver.rules`` holds every enabled rule with its short and full
description, help (the rule's documentation) and default level; each result has
``ruleId``/``ruleIndex``, a level, a message, one physical location (a relative
URI and a region with ``startLine`` and ``startColumn``; for JSONL files the
record's line), the JSON-path location as a logical location, and a partial
fingerprint (the baseline fingerprint) so GitHub tracks results across runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from linter.baseline import fingerprint
from linter.finding import Finding
from linter.runner import LintReport

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVELS = {"error": "error", "warning": "warning", "info": "note"}


def _uri(path: str) -> str:
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            return p.as_uri()
    return p.as_posix() if os.sep == "/" else str(p).replace(os.sep, "/")


def _result(finding: Finding, index: dict[str, int]) -> dict[str, Any]:
    region: dict[str, int] = {"startLine": finding.line or 1}
    if finding.column:
        region["startColumn"] = finding.column
    result: dict[str, Any] = {
        "ruleId": finding.code,
        "ruleIndex": index[finding.code],
        "level": _LEVELS[finding.severity],
        "message": {"text": finding.message},
        "locations": [
            {
                "physicalLocation": {
                    "artifactLocation": {"uri": _uri(finding.path), "uriBaseId": "%SRCROOT%"},
                    "region": region,
                },
                "logicalLocations": [{"fullyQualifiedName": finding.location or f"line {finding.line}", "kind": "member"}],
            }
        ],
        "partialFingerprints": {"prefixgateFingerprint/v1": fingerprint(finding)},
    }
    if finding.tokens_lost is not None:
        result["properties"] = {"tokensLost": finding.tokens_lost}
    return result


def render(report: LintReport, statistics_table: bool = False, color: bool = False) -> str:
    from linter.registry import all_rules

    rules = [r for r in all_rules().values() if r in report.rules or any(f.code == r.code for f in report.findings)]
    index = {r.code: i for i, r in enumerate(rules)}
    driver_rules = [
        {
            "id": r.code,
            "name": r.name,
            "shortDescription": {"text": r.summary},
            "fullDescription": {"text": r.doc.strip().splitlines()[0]},
            "help": {"text": r.doc.strip(), "markdown": "```\n" + r.doc.strip() + "\n```"},
            "defaultConfiguration": {"level": _LEVELS[r.severity]},
            "properties": {"tags": ["prefix-caching", r.scope]},
        }
        for r in rules
    ]
    sarif = {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "prefixgate-lint",
                        "semanticVersion": "0.1.0",
                        "rules": driver_rules,
                    }
                },
                "results": [_result(f, index) for f in report.findings],
                "columnKind": "unicodeCodePoints",
            }
        ],
    }
    return json.dumps(sarif, indent=2, ensure_ascii=False) + "\n"
