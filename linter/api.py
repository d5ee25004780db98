"""The linter's Python API, as the gateway uses it (a stable contract).

* :func:`check_request`: the per-request rules (PS1xx) on one chat-completions
  body; never raises on odd input, imports no torch, well under a millisecond
  for a typical request.
* :func:`compare_requests`: the cross-request rules (PS2xx) for a later request
  of the same conversation or family.
* :func:`conversation_keys` (and :data:`CONVERSATION_HEADER`): which earlier
  request a request continues, one definition for the gateway and the linter
  (:mod:`linter.conversation`); :func:`remember_turn` / :func:`take_previous`
  store a turn under its keys and find the most recent previous one.
* :func:`rule_codes` and :func:`explain`: the registry and each rule's documentation.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from linter import divergence
from linter.conversation import (
    CONVERSATION_HEADER,
    ConversationKeys,
    Turn,
    conversation_keys,
    remember_turn,
    take_previous,
)
from linter.finding import Finding
from linter.registry import all_rules, default_codes, get_rule
from linter.request_families import family_key
from linter.rule import Options, Rule
from linter.tokenizer import Tokenizer

IN_MEMORY_PATH = "<request>"

__all__ = [
    "CONVERSATION_HEADER",
    "ConversationKeys",
    "Turn",
    "check_request",
    "compare_requests",
    "conversation_keys",
    "explain",
    "family_key",
    "remember_turn",
    "rule_codes",
    "take_previous",
]


def _request_rules(select: Collection[str] | None, ignore: Collection[str]) -> list[Rule]:
    chosen = {c.upper() for c in select} if select is not None else default_codes()
    ignored = {c.upper() for c in ignore}
    return [
        rule
        for code, rule in all_rules().items()
        if rule.check_request is not None and code in chosen and code not in ignored
    ]


def check_request(
    body: Mapping[str, Any],
    *,
    select: Collection[str] | None = None,
    ignore: Collection[str] = (),
    allowlist: Sequence[str] = (),
) -> list[Finding]:
    """PS1xx findings for one request body (``path`` is ``"<request>"``, no line or column).

    ``select`` names the rules (default: the default selection, which leaves out
    the opt-in hygiene rules PS102-PS106), ``ignore`` drops codes, and
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
    edits: bool = True,
) -> list[Finding]:
    """PS2xx findings: where ``current`` stops extending ``previous``'s prefix, and why.

    ``current`` is a later turn of the same conversation (:func:`conversation_keys`:
    its whole history should extend ``previous``) or of the same family (only the
    tools, response format and leading instructions should match).
    ``same_conversation`` overrides that inference (pass True when the caller
    found ``previous`` through :func:`conversation_keys`, e.g. by a conversation
    header: then a history truncated at its start is reported too).
    ``edits`` False skips a history that merely differs (pass
    ``not keys.shared``: a shared ``prompt_cache_key`` may name many
    conversations). ``tokens_lost`` is estimated with ``tokenizer`` (default:
    the approximation).
    """
    if not isinstance(previous, Mapping) or not isinstance(current, Mapping):
        return []
    result = divergence.compare(previous, current, tokenizer=tokenizer, same_conversation=same_conversation, edits=edits)
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
