"""Every example ``prefixgate lint --explain`` prints is real: the source rules' (PS3xx)
Anti-pattern and Better blocks are whole Python modules, the first reported by the
rule and the second not; the JSON in the request and conversation rules' examples
parses, and a request built from an Anti-pattern's messages is reported by its rule
and one built from the Better messages is not."""

from __future__ import annotations

import ast
import json
import textwrap
from typing import Any

import pytest

from linter.api import check_request
from linter.registry import all_rules, get_rule
from linter.rule import Options
from linter.source_file import lint_tree

EXAMPLES = ("Anti-pattern", "Better")


def examples(doc: str) -> dict[str, str]:
    """The dedented Anti-pattern and Better blocks of a rule's docstring (as --explain prints them)."""
    lines, found, i = doc.splitlines(), {}, 0
    while i < len(lines):
        if lines[i].strip() in EXAMPLES:
            name, block = lines[i].strip(), []
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            found[name] = textwrap.dedent("\n".join(block)).strip("\n")
            continue
        i += 1
    return found


def json_runs(block: str) -> list[Any]:
    """The JSON values in an example: runs of lines that start with ``{``, ``[`` or ``"``
    (object members), with indented continuation lines; a run of objects is a list."""
    runs: list[list[str]] = []
    for line in block.splitlines():
        if line[:1] in ('{', '[', '"'):
            runs.append([line])
        elif line[:1] == " " and runs:
            runs[-1].append(line)
        else:
            runs.append([])
    values = []
    for run in filter(None, runs):
        if run[0].startswith('"'):
            text = "{" + ", ".join(line.strip() for line in run) + "}"
        elif run[0].startswith("{"):
            text = "[" + " ".join(line.strip() for line in run).rstrip(",") + "]"
        else:
            text = " ".join(run)
        values.append(json.loads(text))
    return values


def test_every_rule_has_both_examples():
    for code, rule in all_rules().items():
        assert set(examples(rule.doc)) == set(EXAMPLES), code


def _source_codes(code: str, source: str) -> list[str]:
    tree = ast.parse(source)
    return [f.code for f in lint_tree("<example>", source, tree, [get_rule(code)], Options())]


@pytest.mark.parametrize("code", [code for code, rule in all_rules().items() if rule.scope == "source"])
def test_source_rule_examples_are_modules_the_rule_judges_as_described(code):
    blocks = examples(get_rule(code).doc)
    compile(blocks["Anti-pattern"], f"{code} anti-pattern", "exec")
    compile(blocks["Better"], f"{code} better", "exec")
    assert code in _source_codes(code, blocks["Anti-pattern"])
    assert _source_codes(code, blocks["Better"]) == []


def _messages(values: list[Any]) -> list[dict[str, Any]]:
    flat = [item for value in values for item in (value if isinstance(value, list) else [value])]
    return [item for item in flat if isinstance(item, dict) and "role" in item]


@pytest.mark.parametrize("code", [code for code, rule in all_rules().items() if rule.scope != "source"])
def test_request_rule_examples_parse_and_their_messages_are_judged_as_described(code):
    blocks = examples(get_rule(code).doc)
    values = {name: json_runs(block) for name, block in blocks.items()}  # raises on broken JSON
    if get_rule(code).scope != "request":
        return  # conversation rules show two requests side by side: JSON checked above
    for name, expected in (("Anti-pattern", True), ("Better", False)):
        messages = _messages(values[name])
        if not messages:
            continue
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": "What is on my calendar?"})
        codes = [f.code for f in check_request({"model": "m", "messages": messages}, select=[code])]
        assert (code in codes) is expected, (name, messages, codes)
