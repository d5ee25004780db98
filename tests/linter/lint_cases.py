"""Shared helpers of the fixture-driven rule tests (cases live in tests/linter/cases/).

* ``psNNN.json`` for request rules: ``{"fail": [{"name", "body", "expected": [[code, location], ...]}], "pass": [{"name", "body"}]}``;
* ``psNNN.json`` for cross-request rules: ``{"fail"|"pass": [{"name", "previous", "current", "expected": [code, location] | null}]}``;
* ``psNNN_cases.py`` for source rules: lines that must be reported carry a
  ``# expect: PSNNN at "TEXT"`` marker, where the finding's column is TEXT's position.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from linter.api import check_request, compare_requests
from linter.registry import get_rule
from linter.rule import Options
from linter.source_file import lint_tree

CASES = Path(__file__).resolve().parent / "cases"
_MARKER = re.compile(r'#\s*expect:\s*(PS\d{3})\s+at\s+"([^"]+)"')


def case_params(code: str, kind: str) -> list:
    data = json.loads((CASES / f"{code.lower()}.json").read_text(encoding="utf-8"))
    return [pytest.param(case, id=case["name"]) for case in data[kind]]


def assert_request_case(code: str, case: dict) -> None:
    found = [[f.code, f.location] for f in check_request(case["body"], select=[code])]
    assert found == case.get("expected", [])
    rule = get_rule(code)
    if found and rule.fix is not None:
        assert check_request(rule.fix(case["body"]), select=[code]) == [], "the rule's fix must remove the finding"


def assert_pair_case(code: str, case: dict) -> None:
    same = case.get("same_conversation")
    found = [[f.code, f.location] for f in compare_requests(case["previous"], case["current"], same_conversation=same)]
    expected = [case["expected"]] if case["expected"] else []
    assert found == expected
    for finding in compare_requests(case["previous"], case["current"], same_conversation=same):
        assert finding.tokens_lost is not None and finding.tokens_lost >= 0


def source_expectations(path: Path, code: str) -> set[tuple[int, int]]:
    expected = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for marker in _MARKER.finditer(line):
            if marker.group(1) == code:
                column = line.index(marker.group(2)) + 1
                expected.add((n, column))
    return expected


def source_findings(path: Path, code: str) -> set[tuple[int, int]]:
    source = path.read_text(encoding="utf-8")
    findings = lint_tree(str(path), source, ast.parse(source), [get_rule(code)], Options())
    assert all(f.code == code for f in findings)
    return {(f.line, f.column) for f in findings}


def assert_source_cases(code: str) -> None:
    path = CASES / f"{code.lower()}_cases.py"
    expected = source_expectations(path, code)
    assert expected, f"{path} has no expect markers"
    assert source_findings(path, code) == expected
