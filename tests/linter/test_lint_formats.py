"""Output formats: snapshots of every format, SARIF against the 2.1.0 schema, annotations, JUnit.

Snapshots live in tests/linter/snapshots/; regenerate them after an intended
change with ``PREFIXGATE_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/linter/test_lint_formats.py``.
"""

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest
from lint_cli_helpers import ROOT, run_lint

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
SARIF_SCHEMA = Path(__file__).resolve().parents[2].parent / "shared/data/sarif-schema-2.1.0.json"
INPUTS = ["examples/requests.jsonl", "examples/prompt_builder.py"]
UPDATE = os.environ.get("PREFIXGATE_UPDATE_SNAPSHOTS") == "1"


@pytest.fixture
def lint_output(tmp_path, monkeypatch, capsys):
    config = tmp_path / "pyproject.toml"
    config.write_text("")
    monkeypatch.chdir(ROOT)

    def run(*argv):
        code = run_lint([*INPUTS, *argv], config)
        return code, capsys.readouterr().out

    return run


@pytest.mark.parametrize(
    ("fmt", "extra", "suffix"),
    [("text", ["--statistics"], "txt"), ("json", ["--statistics"], "json"), ("sarif", [], "sarif"), ("github", [], "txt"), ("junit", [], "xml")],
)
def test_snapshot(lint_output, fmt, extra, suffix):
    code, out = lint_output("--format", fmt, *extra)
    assert code == 1
    snapshot = SNAPSHOTS / f"examples.{fmt}.{suffix}"
    if UPDATE:
        snapshot.write_text(out, encoding="utf-8")
    assert snapshot.is_file(), f"missing snapshot {snapshot}; run with PREFIXGATE_UPDATE_SNAPSHOTS=1"
    assert out == snapshot.read_text(encoding="utf-8")


def test_sarif_is_valid_2_1_0(lint_output):
    _, out = lint_output("--format", "sarif")
    sarif = json.loads(out)
    if SARIF_SCHEMA.is_file():
        schema = json.loads(SARIF_SCHEMA.read_text(encoding="utf-8"))
        jsonschema.validate(sarif, schema)
    else:  # only the schema check is skipped; the GitHub checks below still run
        pytest.skip(f"SARIF schema not found at {SARIF_SCHEMA} (needs the shared data folder next to the repo)")


def test_sarif_has_what_github_code_scanning_needs(lint_output):
    _, out = lint_output("--format", "sarif")
    run = json.loads(out)["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == sorted(r["id"] for r in rules)
    for rule in rules:
        assert rule["shortDescription"]["text"] and rule["fullDescription"]["text"] and rule["help"]["text"]
    assert len(run["results"]) == 12
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        location = result["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uri"] in INPUTS
        assert location["region"]["startLine"] >= 1 and location["region"]["startColumn"] >= 1
        assert result["level"] in ("error", "warning", "note")
    jsonl = [r for r in run["results"] if r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith(".jsonl")]
    assert {r["locations"][0]["physicalLocation"]["region"]["startLine"] for r in jsonl} == {3, 4, 5, 6, 8, 14, 16}


def test_json_has_findings_and_summary(lint_output):
    _, out = lint_output("--format", "json")
    data = json.loads(out)
    for finding in data["findings"]:
        assert set(finding) >= {"code", "severity", "message", "path", "line", "column", "tokens_lost"}
    summary = data["summary"]
    assert summary["requests"] == 16 and summary["prompt_tokens"] > 0
    assert 0 < summary["hit_rate"] < summary["hit_rate_after_fixes"] <= 1


def test_github_annotations(lint_output):
    _, out = lint_output("--format", "github")
    lines = out.splitlines()
    pattern = re.compile(r"^::(error|warning|notice) file=[^,]+,line=\d+(,col=\d+)?,title=[^:]+::PS\d{3}: .+$")
    assert all(pattern.match(line) for line in lines[:-1]), lines
    assert lines[-1].startswith("::notice title=prefixgate lint::16 requests")


def test_junit_counts_failures(lint_output):
    _, out = lint_output("--format", "junit")
    suite = ET.fromstring(out.split("\n", 1)[1]).find("testsuite")
    assert suite.get("failures") == "12" and len(suite.findall("testcase")) == 12
    assert {c.find("failure").get("type") for c in suite.findall("testcase")} >= {"PS101", "PS301"}


def test_text_is_coloured_only_when_asked(lint_output):
    _, plain = lint_output()
    assert "\033[" not in plain
    _, coloured = lint_output("--color", "always")
    assert "\033[31m" in coloured
