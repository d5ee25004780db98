"""Linting one Python source file with the PS3xx rules, honouring inline suppressions.

``# prefixgate: noqa`` at the end of a line suppresses every finding on that
line; ``# prefixgate: noqa: PS301, PS302`` only those codes. A file that does not
parse, or is nested too deeply to parse or analyse, is reported as a load
problem, never raised.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from collections.abc import Collection
from pathlib import Path

from linter.corpus import LoadProblem
from linter.finding import Finding
from linter.rule import Options, Rule

_NOQA = re.compile(r"#\s*prefixgate:\s*noqa(?::\s*(?P<codes>[A-Za-z0-9, ]+))?", re.IGNORECASE)
ALL_CODES = "*"


def noqa_lines(source: str) -> dict[int, set[str]]:
    """Line -> suppressed codes (``{"*"}`` for all) from ``# prefixgate: noqa`` comments."""
    found: dict[int, set[str]] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            match = _NOQA.search(token.string)
            if match is None:
                continue
            codes = match.group("codes")
            found[token.start[0]] = {c.strip().upper() for c in codes.split(",") if c.strip()} if codes else {ALL_CODES}
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


def lint_source(path: Path, rules: Collection[Rule], options: Options, problems: list[LoadProblem]) -> list[Finding]:
    """Findings of the source ``rules`` in one file, minus suppressed ones."""
    name = str(path)
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=name)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(LoadProblem(name, 1, f"cannot read file: {exc}"))
        return []
    except SyntaxError as exc:
        problems.append(LoadProblem(name, exc.lineno or 1, f"syntax error: {exc.msg}"))
        return []
    except (RecursionError, MemoryError):
        problems.append(LoadProblem(name, 1, "too deeply nested to parse"))
        return []
    try:
        return lint_tree(name, source, tree, rules, options)
    except RecursionError:
        problems.append(LoadProblem(name, 1, "too deeply nested to analyse"))
        return []


def lint_tree(name: str, source: str, tree: ast.Module, rules: Collection[Rule], options: Options) -> list[Finding]:
    suppressed = noqa_lines(source)
    options = dataclasses.replace(options, source_path=name)
    findings: list[Finding] = []
    for rule in rules:
        if rule.check_source is None:
            continue
        for hit in rule.check_source(tree, options):
            codes = suppressed.get(hit.line or 0, set())
            if ALL_CODES in codes or rule.code in codes:
                continue
            findings.append(
                Finding(rule.code, rule.severity, hit.message, name, hit.line, hit.column, f"line {hit.line}", hit.tokens_lost)
            )
    return findings
