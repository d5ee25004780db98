"""The linter's Python API, as the gateway uses it (a stable contract).

* :func:`check_request`: the per-request rules (PS1xx) on one chat-completions
  body; never raises on odd input, imports no torch, well under a millisecond
  for a typical request.
* :func:`compare_requests`: the cross-request rules (PS2xx) for a later request
  of the same conversation or family.
* :func:`rule_codes` and :func:`explain`: the registry and each rule's documentation.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from linter import divergence
from linter.finding import Finding
from linter.registry import all_rules, get_rule
from linter.rule import Options, Rule
from linter.tokenizer import Tokenizer

IN_MEMORY_PATH = "<request>"


def _request_rules(select: Collection[str] | None, ignore: Collection[str]) -> list[Rule]:
    chosen = {c.upper() for c in select} if select is not None else None
    ignored = {c.upper() for c in ignore}
    return [
        rule
        for code, rule in all_rules().items()
        if rule.check_request is not None
        and (chosen is None or code in chosen)
        and code not in ignored
    ]


def check_request(
    body: Mapping[str, Any],
    *,
    select: Collection[str] | None = None,
    ignore: Collection[str] = (),
    allowlist: Sequence[str] = (),
) -> list[Finding]:
    """PS1xx findings for one request body (``path`` is ``"<request>"``, no line or column).

    ``select`` limits the rules to those codes, ``ignore`` drops codes, and
    ``allowlist`` holds regexes of values PS101 accepts. Malformed parts of the
    body are skipped; a body that is not a mapping yields no findings.
    """
    if not isinstance(body, Mapping):
        return []
    options = Options(allowlist=tuple(allowlist))
    findings: list[Finding] = []
    for rule in _request_rules(select, ignore):
        assert rule.check_request is not None
        for hit in rule.check_request(body, options):
            findings.append(
                Finding(rule.code, rule.severity, hit.message, IN_MEMORY_PATH, None, None, hit.location, hit.tokens_lost)
            )
    return findings


def compare_requests(
    previous: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    tokenizer: Tokenizer | None = None,
    same_conversation: bool | None = None,
) -> list[Finding]:
    """PS2xx findings: where ``current`` stops extending ``previous``'s prefix, and why.

    ``current`` is a later turn of the same conversation (same first non-system
    message: its whole history should extend ``previous``) or of the same family
    (only the tools, response format and leading instructions should match).
    ``same_conversation`` overrides that inference (pass True when the caller
    knows, e.g. from a conversation header, that both are turns of one
    conversation: then a history truncated at its start is reported too).
    ``tokens_lost`` is estimated with ``tokenizer`` (default: the approximation).
    """
    if not isinstance(previous, Mapping) or not isinstance(current, Mapping):
        return []
    result = divergence.compare(previous, current, tokenizer=tokenizer, same_conversation=same_conversation)
    if result is None:
        return []
    rule = get_rule(result.code)
    return [
        Finding(rule.code, rule.severity, result.message, IN_MEMORY_PATH, None, None, result.location, result.tokens_lost)
    ]


def rule_codes() -> list[str]:
    """Every rule code, sorted."""
    return list(all_rules())


def explain(code: str) -> str:
    """The documentation of rule ``code`` (its module's docstring); ValueError if unknown."""
    return get_rule(code).doc.strip() + "\n"
