"""Recognising volatile values: text that changes from one request to the next.

A volatile value (a timestamp, a UUID, a nonce, a session id) in the part of a
prompt that many requests share makes every request's prefix unique, so nothing
after it is ever served from the prefix cache.

:func:`find_volatile` returns non-overlapping :class:`VolatileSpan` objects in text
order. Patterns are anchored on word boundaries and tuned for few false positives
on prose: a hex run must mix digits and letters, an epoch must fall in
2001..2286 (10 digits, or 13 with milliseconds).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_LONG_MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December"
)
_DAYS = "Mon|Tue|Wed|Thu|Fri|Sat|Sun"

# (kind, pattern). Order matters: earlier kinds win when two patterns overlap.
_PATTERNS: tuple[tuple[str, str], ...] = (
    ("JWT", r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"),
    ("trace id", r"\b00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]\b"),
    (
        "ISO-8601 timestamp",
        r"\b\d{4}-[01]\d-[0-3]\d[T ][0-2]\d:[0-5]\d(?::[0-5]\d(?:\.\d{1,9})?)?(?:Z|[+-][0-2]\d:?[0-5]\d)?",
    ),
    (
        "RFC 2822 timestamp",
        rf"\b(?:(?:{_DAYS}),\s+)?[0-3]?\d\s+(?:{_MONTHS})\s+\d{{4}}\s+[0-2]\d:[0-5]\d(?::[0-5]\d)?"
        r"(?:\s+(?:[+-]\d{4}|GMT|UTC|Z))?",
    ),
    ("UUID", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    (
        "request/session id",
        r"(?i:\b(?:request|req|session|sess|trace|span|correlation|conversation|run|nonce)"
        r"[ _-]?(?:id|key)?\s*[:=]\s*[\"']?)(?=[A-Za-z0-9._-]*\d)[A-Za-z0-9._-]{6,}",
    ),
    ("prefixed id", r"\b(?:req|sess|trace|chatcmpl|run|msg|call)[_-][A-Za-z0-9]{10,}\b"),
    ("ULID", r"\b[0-7][0-9A-HJKMNP-TV-Z]{25}\b"),
    ("date", r"\b\d{4}-[01]\d-[0-3]\d\b|\b[0-3]?\d/[0-3]?\d/\d{4}\b"),
    (
        "date",
        rf"\b(?:{_LONG_MONTHS}|{_MONTHS})\.?\s+[0-3]?\d(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
        rf"|\b[0-3]?\d(?:st|nd|rd|th)?\s+(?:{_LONG_MONTHS}|{_MONTHS})\.?,?\s+\d{{4}}\b",
    ),
    ("time of day", r"\b[0-2]\d:[0-5]\d:[0-5]\d\b"),
    ("epoch time", r"(?<![\d.])(?:[1-9]\d{9}|[1-9]\d{12})(?![\d.])"),
    ("hex nonce", r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b"),
)

_EPOCH_MIN, _EPOCH_MAX = 978_307_200, 9_999_999_999  # 2001-01-01 .. 2286


@dataclass(frozen=True, slots=True)
class VolatileSpan:
    """``text[start:end]`` looks like a value of ``kind`` that changes per request."""

    kind: str
    start: int
    end: int
    value: str


_COMBINED = re.compile("|".join(f"(?P<k{i}>{p})" for i, (_, p) in enumerate(_PATTERNS)))
_KINDS = {f"k{i}": kind for i, (kind, _) in enumerate(_PATTERNS)}
# A cheap pre-filter: every pattern but the JWT one needs a digit.
_MAYBE_VOLATILE = re.compile(r"\d|eyJ")


@lru_cache(maxsize=64)
def _compile_allowlist(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ValueError(f"invalid allowlist pattern {p!r}: {exc}") from None
    return tuple(compiled)


def _epoch_plausible(value: str) -> bool:
    seconds = int(value[:10])
    return _EPOCH_MIN <= seconds <= _EPOCH_MAX


_MEMO: dict[tuple[str, tuple[str, ...]], tuple[VolatileSpan, ...]] = {}
_MEMO_LIMIT = 20_000


def find_volatile(text: str, allowlist: Sequence[str] = ()) -> tuple[VolatileSpan, ...]:
    """Volatile spans in ``text``, in order, skipping values matched by an allowlist regex.

    An allowlist pattern suppresses a span when it matches the span's value
    (``re.search``). Invalid allowlist patterns raise ValueError. Results are
    memoized per (text, allowlist): instructions and tool texts repeat across
    requests, so a log or a gateway scans each distinct text once.
    """
    if not text or _MAYBE_VOLATILE.search(text) is None:
        return ()
    key = (text, tuple(allowlist))
    found = _MEMO.get(key)
    if found is None:
        found = _scan(text, key[1])
        if len(_MEMO) >= _MEMO_LIMIT:
            _MEMO.clear()
        _MEMO[key] = found
    return found


def _scan(text: str, allowlist: tuple[str, ...]) -> tuple[VolatileSpan, ...]:
    allowed = _compile_allowlist(allowlist) if allowlist else ()
    spans: list[VolatileSpan] = []
    for match in _COMBINED.finditer(text):
        group = match.lastgroup
        assert group is not None
        kind = _KINDS[group]
        value = match.group()
        if kind == "epoch time" and not _epoch_plausible(value):
            continue
        if any(p.search(value) for p in allowed):
            continue
        spans.append(VolatileSpan(kind, match.start(), match.end(), value))
    return tuple(spans)


@lru_cache(maxsize=8192)
def _mask(text: str, allowlist: tuple[str, ...]) -> str:
    return mask_volatile(text, allowlist)


def mask_volatile_cached(text: str, allowlist: tuple[str, ...] = ()) -> str:
    """:func:`mask_volatile`, memoized (instructions repeat across a log)."""
    return _mask(text, allowlist)


def mask_volatile(text: str, allowlist: Sequence[str] = ()) -> str:
    """``text`` with every volatile span replaced by ``<kind>`` (for grouping requests)."""
    spans = find_volatile(text, allowlist)
    if not spans:
        return text
    parts: list[str] = []
    pos = 0
    for span in spans:
        parts.append(text[pos : span.start])
        parts.append(f"<{span.kind}>")
        pos = span.end
    parts.append(text[pos:])
    return "".join(parts)
