"""PS102 user-data-in-instructions: user-specific data in a system or developer message.

Why it matters
    The instructions are the part every user of an application shares. Writing
    the user's name, email, phone number, account or id into them forks the
    prefix per user: each user gets a private copy of the cache for the
    instructions (and the tools rendered before them only go as far as the
    first such value), and cache memory fills with near-duplicates.

Anti-pattern
    {"role": "system", "content": "You help Ada Lovelace (ada@example.com, customer id 88412)."}

Better
    Keep the instructions generic and pass the user's details in the first user
    message (or a short context message after the instructions):
    {"role": "system", "content": "You help the customer described in the first message."},
    {"role": "user", "content": "Customer: Ada Lovelace <ada@example.com>, id 88412\\n\\n..."}

Opt-in hygiene rule (``--extend-select PS102``): an email or a name in the
instructions may be the same in every request (a support address), so it is
not a break by itself. In the default rules, requests of one application whose
instructions differ are reported where they differ (PS206, PS201).
Detected: email addresses, phone numbers, labelled user fields ("user id:",
"customer name is ..."), and the request's own ``user`` field value.
Fix used by the estimate: the values are moved after the stable prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

from linter import chat_request
from linter.rule import Body, Hit, Options, Rule
from linter.span_mover import move_spans_to_end

_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
# International (+CC ...) or North American (555-123-4567, (555) 123-4567) numbers;
# dates and lists of numbers do not match.
_PHONE = re.compile(
    r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,4}\d\b"
    r"|(?<![\w-])(?:\(\d{3}\)\s?|\d{3}[.-])\d{3}[.-]\d{4}\b"
)
_FIELD = re.compile(
    r"(?i:\b(?:the\s+)?(?:user|customer|client|account|member|patient)(?:'s)?[ _-]?"
    r"(?:name|id|email|number|phone|address)\b\s*(?:is\s+|:\s*|=\s*))[^\s,;.]+(?:\s+[A-Z][\w'-]+)?"
)
_FIELD_WORDS = ("user", "customer", "client", "account", "member", "patient")
_HAS_DIGIT = re.compile(r"\d")


@lru_cache(maxsize=4096)
def _pattern_spans(text: str) -> tuple[tuple[int, int, str], ...]:
    """Email, phone and labelled-field spans (cheap substring checks gate each regex)."""
    spans: list[tuple[int, int, str]] = []
    if "@" in text:
        spans += [(m.start(), m.end(), "email address") for m in _EMAIL.finditer(text)]
    if _HAS_DIGIT.search(text):
        spans += [(m.start(), m.end(), "phone number") for m in _PHONE.finditer(text)]
    lower = text.lower()
    if any(word in lower for word in _FIELD_WORDS):
        spans += [(m.start(), m.end(), "user field") for m in _FIELD.finditer(text)]
    return tuple(spans)


@lru_cache(maxsize=4096)
def mask_user_data(text: str) -> str:
    """``text`` with every email, phone number and labelled user field replaced by a placeholder."""
    spans = _pattern_spans(text)
    if not spans:
        return text
    out, pos = [], 0
    for start, end, _ in sorted(spans):
        if start >= pos:
            out.append(text[pos:start] + "<user>")
            pos = end
    return "".join(out) + text[pos:]


def _spans(text: str, user: str | None) -> list[tuple[int, int, str]]:
    spans = list(_pattern_spans(text))
    if user and len(user) >= 3:
        start = text.find(user)
        while start >= 0:
            spans.append((start, start + len(user), "the request's user id"))
            start = text.find(user, start + len(user))
    spans.sort()
    kept: list[tuple[int, int, str]] = []
    for span in spans:
        if not kept or span[0] >= kept[-1][1]:
            kept.append(span)
    return kept


def _user(body: Mapping[str, Any]) -> str | None:
    user = body.get("user")
    return user if isinstance(user, str) else None


def check(body: Body, options: Options) -> Iterator[Hit]:
    user = _user(body)
    for i, message in chat_request.messages(body):
        if chat_request.role(message) not in chat_request.STATIC_ROLES:
            continue
        for location, text in chat_request.content_texts(message, f"messages[{i}]"):
            for start, end, kind in _spans(text, user):
                yield Hit(
                    message=f"{kind} {text[start:end]!r} in the instructions forks the shared prefix per user",
                    location=f"{location}[{start}:{end}]",
                    needle=text[start:end],
                )


def fix(body: Body) -> Body:
    user = _user(body)

    def finder(text: str) -> list[tuple[int, int]]:
        return [(s, e) for s, e, _ in _spans(text, user)]

    return move_spans_to_end(body, finder)


RULE = Rule(
    code="PS102",
    name="user-data-in-instructions",
    severity="warning",
    scope="request",
    summary="A user's name, email, phone or id in a system/developer message",
    doc=__doc__ or "",
    check_request=check,
    fix=fix,
    default=False,
)
