"""Every rule, one runner: the fixture files in tests/linter/cases/ drive all rule tests.

* ``psNNN.json`` for request rules (PS1xx): ``{"fail": [{"name", "body", "expected": [[code, location], ...]}],
  "pass": [{"name", "body"}]}``; the rule's fix must remove what it found.
* ``psNNN.json`` for cross-request rules (PS2xx): ``{"fail"|"pass": [{"name", "previous", "current",
  "expected": [code, location] | null, "same_conversation": true (optional)}]}``; a finding's
  ``tokens_lost`` is measured (an integer >= 0).
* ``psNNN_cases.py`` for source rules (PS3xx): every line that must be reported carries a
  ``# expect: PSNNN at "TEXT"`` marker (the finding's column is TEXT's position); nothing else is reported.

Adding a rule means adding its fixture file: a rule without one fails here. The rule
reference in docs/linter.md is checked against the rules' docstrings too.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from linter.api import check_request, compare_requests
from linter.registry import all_rules, default_codes, get_rule
from linter.rule import Options
from linter.rule_reference import END, START, render_reference
from linter.source_file import lint_tree

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "cases"
_MARKER = re.compile(r'#\s*expect:\s*(PS\d{3})\s+at\s+"(.+)"\s*$')


def _fixture(code: str) -> Path:
    rule = get_rule(code)
    return CASES / (f"{code.lower()}_cases.py" if rule.scope == "source" else f"{code.lower()}.json")


def _json_params() -> list:
    params = []
    for code, rule in all_rules().items():
        if rule.scope == "source":
            continue
        data = json.loads(_fixture(code).read_text(encoding="utf-8"))
        for kind in ("fail", "pass"):
            for case in data[kind]:
                params.append(pytest.param(code, kind, case, id=f"{code}-{kind}-{case['name']}"))
    return params


def test_every_rule_has_a_fixture_with_failing_and_passing_cases():
    for code, rule in all_rules().items():
        path = _fixture(code)
        assert path.is_file(), f"{code} has no fixture file {path.name}"
        if rule.scope == "source":
            assert _expectations(path, code), f"{path.name} has no expect markers"
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
            assert data["fail"] and data["pass"], f"{path.name} needs fail and pass cases"


@pytest.mark.parametrize(("code", "kind", "case"), _json_params())
def test_request_and_pair_cases(code, kind, case):
    rule = get_rule(code)
    if rule.scope == "request":
        found = [[f.code, f.location] for f in check_request(case["body"], select=[code])]
        assert found == case.get("expected", [])
        assert (kind == "fail") == bool(found)
        if found and rule.fix is not None:
            assert check_request(rule.fix(case["body"]), select=[code]) == [], "the rule's fix must remove the finding"
    else:
        same = case.get("same_conversation")
        findings = compare_requests(case["previous"], case["current"], same_conversation=same)
        expected = [case["expected"]] if case.get("expected") else []
        assert [[f.code, f.location] for f in findings] == expected
        assert (kind == "fail") == bool(findings)
        for finding in findings:
            assert finding.tokens_lost is not None and finding.tokens_lost >= 0


def _expectations(path: Path, code: str) -> set[tuple[int, int]]:
    expected = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        marker = _MARKER.search(line)
        if marker is not None and marker.group(1) == code:
            expected.add((n, line.index(marker.group(2)) + 1))
    return expected


@pytest.mark.parametrize("code", [c for c, r in all_rules().items() if r.scope == "source"])
def test_source_cases(code):
    path = _fixture(code)
    source = path.read_text(encoding="utf-8")
    findings = lint_tree(str(path), source, ast.parse(source), [get_rule(code)], Options())
    assert {(f.line, f.column) for f in findings} == _expectations(path, code)


def test_default_selection_leaves_out_the_opt_in_hygiene_rules():
    assert default_codes() == set(all_rules()) - {"PS102", "PS103", "PS104", "PS105", "PS106"}


def test_docs_rule_reference_is_generated_from_the_docstrings():
    document = (ROOT / "docs" / "linter.md").read_text(encoding="utf-8")
    generated = document.split(START, 1)[1].split(END, 1)[0]
    assert generated == "\n" + render_reference(), "run: python -m linter.rule_reference docs/linter.md"
