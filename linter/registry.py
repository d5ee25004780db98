"""The rule registry: every rule module, imported once, in code order.

Adding a rule means adding ``linter/rules/<code>.py`` (defining ``RULE``) and its
module name to :data:`RULE_MODULES`; :func:`all_rules` checks that each module's
file name matches its code.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from linter.rule import Rule

RULE_MODULES: tuple[str, ...] = (
    "ps101", "ps102", "ps103", "ps104", "ps105", "ps106",
    "ps201", "ps202", "ps203", "ps204", "ps205", "ps206", "ps207",
    "ps301", "ps302", "ps303", "ps304", "ps305",
)


@lru_cache(maxsize=1)
def all_rules() -> dict[str, Rule]:
    """Every rule by code, sorted by code."""
    rules: dict[str, Rule] = {}
    for name in RULE_MODULES:
        module = importlib.import_module(f"linter.rules.{name}")
        rule: Rule = module.RULE
        assert rule.code.lower() == name, f"module {name} defines {rule.code}"
        rules[rule.code] = rule
    return dict(sorted(rules.items()))


def default_codes() -> set[str]:
    """The codes of the default selection (rules with ``default=True``)."""
    return {code for code, rule in all_rules().items() if rule.default}


def get_rule(code: str) -> Rule:
    """The rule with ``code`` (case-insensitive); ValueError for an unknown code."""
    rule = all_rules().get(code.upper())
    if rule is None:
        raise ValueError(f"unknown rule code {code!r}; run 'prefixgate lint --list-rules'")
    return rule


def expand_codes(selectors: object) -> set[str]:
    """Rule codes matched by selectors: a full code (``PS101``), a prefix (``PS1``, ``PS``) or ``ALL``.

    ValueError for a selector that matches no rule.
    """
    if not isinstance(selectors, (list, tuple, set, frozenset)):
        raise ValueError(f"rule selectors must be a list of codes, got {selectors!r}")
    codes = set(all_rules())
    chosen: set[str] = set()
    for selector in selectors:
        if not isinstance(selector, str):
            raise ValueError(f"rule selector must be a string, got {selector!r}")
        s = selector.strip().upper()
        matched = codes if s == "ALL" else {c for c in codes if c.startswith(s)}
        if not matched:
            raise ValueError(f"rule selector {selector!r} matches no rule; run 'prefixgate lint --list-rules'")
        chosen |= matched
    return chosen
