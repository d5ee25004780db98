"""Open-mode tenant ids and the short labels reports show for them.

In open mode (no config) every distinct bearer token is its own tenant, and the
tenant's id is what its cache salt scope, its history and its stats rows are keyed
by: ``open-`` and the first :data:`ID_HEX` hex digits (128 bits) of the token's
SHA-256, so guessing another tenant's id is as hard as a 128-bit search. Ids written
by earlier versions carry 12 hex digits (48 bits); they stay readable.

A 37-character id is unreadable in a chart, and the key itself must never be shown,
so reports name an open-mode tenant by a *label*: ``open-`` and the first
:data:`LABEL_HEX` hex digits of its id, longer where two different tenants of the
same report would share it. ``prefixgate keys label`` prints the label (and the id)
of a key, so a user can tell which line is theirs. Configured tenants keep their
configured names as labels.

Invariants: :func:`open_tenant_id` is a pure function of the token; two ids get the
same label from :func:`labels` only when one's hex digits start with the other's
(the same key before and after the id grew to 128 bits), so merging rows by label
never mixes two keys (but for a 48-bit prefix collision of an old id).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

OPEN_PREFIX = "open-"
ID_HEX = 32
LABEL_HEX = 8
_OPEN_ID = re.compile(r"^open-([0-9a-f]{12,64})$")


def open_tenant_id(token: str) -> str:
    """The open-mode tenant id of a bearer token (128 bits of its SHA-256)."""
    return OPEN_PREFIX + hashlib.sha256(token.encode("utf-8")).hexdigest()[:ID_HEX]


def label_of_key(token: str) -> str:
    """The label reports show for the open-mode tenant of ``token`` (when no other
    tenant's id starts with the same :data:`LABEL_HEX` digits)."""
    return open_tenant_id(token)[: len(OPEN_PREFIX) + LABEL_HEX]


def _compatible(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def labels(names: Iterable[str]) -> dict[str, str]:
    """A label for every tenant name: open-mode ids shortened (see the module docstring),
    every other name unchanged. Each label has at least :data:`LABEL_HEX` digits and as
    many more as it takes to differ from every other key's id in ``names``."""
    result: dict[str, str] = {}
    digits: list[str] = []
    for name in set(names):
        match = _OPEN_ID.match(name)
        if match is None:
            result[name] = name
        else:
            digits.append(match.group(1))
    digits.sort()
    # In sorted order the common prefix with another string shrinks with the distance,
    # so the nearest different key on each side is the one to differ from.
    for index, own in enumerate(digits):
        needed = LABEL_HEX
        for step in (-1, 1):
            other = index + step
            while 0 <= other < len(digits) and _compatible(own, digits[other]):
                other += step
            if 0 <= other < len(digits):
                needed = max(needed, _common(own, digits[other]) + 1)
        result[OPEN_PREFIX + own] = OPEN_PREFIX + own[:needed]
    return result
