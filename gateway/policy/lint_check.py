"""The prefix check itself: the linter's findings on one request, as warnings, bounded.

Pure functions of parsed bodies, so they run the same on the event loop, on a thread or
in the helper process (:mod:`gateway.policy.lint_process`); the scheduling around them is
:class:`~gateway.policy.prefix_warner.PrefixWarner`'s. A rule that raises is logged and
dropped, never fails the request.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from linter.api import check_request, compare_requests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixWarning:
    code: str
    severity: str
    message: str
    location: str
    tokens_lost: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "location": self.location,
            "tokens_lost": self.tokens_lost,
        }


def _convert(findings: list[Any]) -> list[PrefixWarning]:
    return [
        PrefixWarning(f.code, f.severity, f.message, f.location, f.tokens_lost) for f in findings
    ]


def request_warnings(original: Mapping[str, Any]) -> list[PrefixWarning]:
    """The linter's per-request rules on the body as the client sent it. Never raises."""
    try:
        return _convert(check_request(original))
    except Exception:
        log.exception("linter check_request failed; continuing without its warnings")
        return []


def turn_warnings(
    previous: Mapping[str, Any] | None, canonical: Mapping[str, Any], edits: bool = True
) -> list[PrefixWarning]:
    """The comparison of ``canonical`` with the conversation's ``previous`` turn (history
    edits reported only when ``edits``; see :func:`linter.api.compare_requests`). Never raises."""
    if previous is None:
        return []
    try:
        return _convert(compare_requests(previous, canonical, same_conversation=True, edits=edits))
    except Exception:
        log.exception("linter compare_requests failed; continuing without its warnings")
        return []


def lint(
    original: Mapping[str, Any], previous: Mapping[str, Any] | None, canonical: Mapping[str, Any],
    edits: bool = True,
) -> list[PrefixWarning]:
    """The linter's findings: :func:`request_warnings`, then :func:`turn_warnings`."""
    return request_warnings(original) + turn_warnings(previous, canonical, edits)


def light(value: Any, max_chars: int) -> bool:
    """Whether ``value`` (parsed JSON) is cheap to lint on the event loop: no string that
    is a ``data:`` URL and at most ``max_chars`` characters of strings and items in all.
    The walk stops as soon as either fails, so it costs O(``max_chars``) at most."""
    stack, cost = [value], 0
    while stack:
        item = stack.pop()
        cost += 1
        if isinstance(item, str):
            cost += len(item)
            if item.startswith("data:"):
                return False
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        if cost > max_chars:
            return False
    return True


def bound_warnings(
    warnings: list[PrefixWarning], max_warnings: int, max_bytes: int
) -> list[PrefixWarning]:
    """The first warnings that fit both bounds, then one summary per code for the rest."""
    kept: list[PrefixWarning] = []
    size = 0
    for index, warning in enumerate(warnings):
        cost = len(warning.message) + len(warning.location) + 64
        if len(kept) >= max_warnings or size + cost > max_bytes:
            rest = Counter(w.code for w in warnings[index:])
            severity = {w.code: w.severity for w in warnings[index:]}
            kept.extend(
                PrefixWarning(code, severity[code], f"{count} more {code} findings not listed "
                              f"(at most {max_warnings} warnings per request)", "")
                for code, count in sorted(rest.items())
            )
            return kept
        kept.append(warning)
        size += cost
    return kept
