"""piecewise_json: ``orjson.loads`` in bounded pieces, so a large body cannot hold the GIL long.

``orjson.loads`` never releases the GIL: parsing a 1.8 MB chat body of 40,000 messages on a
worker thread still holds it ~60 ms in one go, and the event loop's thread waits that long.
:func:`loads` gives the same result in pieces of about :data:`PIECE_BYTES`:

1. a string-aware scan (Python, so it yields the GIL every switch interval) finds the
   top-level object's array values larger than a piece, and in each the ends of elements
   (after a closing bracket or a string) about every :data:`PIECE_BYTES`;
2. the body with those arrays emptied (the "skeleton") is one ``orjson.loads``, and each
   run of elements another, as ``[`` run ``]``; the runs are joined by the commas found.

Invariant: the result is ``orjson.loads(raw)`` for every input, and an invalid input raises
exactly the ``orjson.JSONDecodeError`` of ``orjson.loads(raw)``: any doubt (a piece or the
skeleton refused, an empty run, a separator that is not a comma, a duplicate split key, a
body nested deeper than :data:`MAX_SCAN_DEPTH`) falls back to one ``orjson.loads(raw)``.
The skeleton and the runs together are every byte of the body, so a body whose pieces all
parse is valid JSON. Work per call on the GIL without a switch: one piece (elements longer
than a piece and other large values, such as a long string, are parsed whole).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

PIECED_ABOVE_BYTES = 256 * 1024  # smaller bodies are one orjson.loads
PIECE_BYTES = 64 * 1024
MAX_SCAN_DEPTH = 200  # deeper bodies are one orjson.loads (refused later as too deep)

# A whole object without brackets outside its strings (most chat messages: one match), a
# complete string (escapes skipped), or one bracket; brackets inside strings are never seen.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_TOKEN = re.compile(rb'\{(?:[^{}\[\]"]++|' + _STRING + rb')*+\}|' + _STRING + rb'|[\[\]{}]', re.DOTALL)
_COLON = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*\Z")
_COMMA = re.compile(rb"[ \t\n\r]*,")


def loads(raw: bytes) -> Any:
    """``orjson.loads(raw)``, parsed in pieces when ``raw`` is over :data:`PIECED_ABOVE_BYTES`."""
    if len(raw) <= PIECED_ABOVE_BYTES:
        return orjson.loads(raw)
    splits = _plan(raw)
    if splits is not None:
        result = _assemble(raw, splits)
        if result is not None:
            return result
    return orjson.loads(raw)  # the same value, or the same error


# (key, the array's "[" offset, its "]" offset, the runs' (start, end) inside it)
_Split = tuple[str, int, int, list[tuple[int, int]]]


def _plan(raw: bytes) -> list[_Split] | None:
    """The large top-level arrays and their runs of elements; None when the body is not an
    object or the scan is in doubt."""
    if raw.lstrip(b" \t\n\r")[:1] != b"{":
        return None
    splits: list[_Split] = []
    stack: list[int] = []  # the open brackets' bytes: ord("{") or ord("[")
    key_token: tuple[int, int] | None = None  # the last string at depth 1 (a key, when followed by ":")
    array: tuple[str, int] | None = None  # the top-level array being scanned: key, "[" offset
    runs: list[tuple[int, int]] = []
    run_start = 0
    for match in _TOKEN.finditer(raw):
        start, end = match.span()
        first = raw[start]
        if first == 0x22 or end - start > 1:  # a string, or a whole object
            if len(stack) == 1 and first == 0x22:
                key_token = (start, end)
            elif array is not None and len(stack) == 2 and end - run_start >= PIECE_BYTES:
                run_start = _cut(raw, runs, run_start, end)
            continue
        if first in (0x7B, 0x5B):  # "{" "["
            stack.append(first)
            if len(stack) > MAX_SCAN_DEPTH:
                return None
            if first == 0x5B and len(stack) == 2 and key_token is not None:
                if _COLON.match(raw, key_token[1], start) is None:
                    return None
                try:
                    key = orjson.loads(raw[key_token[0]:key_token[1]])
                except orjson.JSONDecodeError:
                    return None
                array, runs, run_start = (key, start), [], start + 1
            continue
        if not stack or stack.pop() != first - 2:  # "}" is "{" + 2, "]" is "[" + 2
            return None
        if array is not None and len(stack) == 2 and end - run_start >= PIECE_BYTES:
            run_start = _cut(raw, runs, run_start, end)
        elif array is not None and len(stack) == 1:  # the array closed
            key, opened = array
            array = None
            if runs:  # larger than a piece: split
                runs.append((run_start, start))
                splits.append((key, opened, start, runs))
    if stack or not splits or len({key for key, *_ in splits}) != len(splits):
        return None
    return splits


def _cut(raw: bytes, runs: list[tuple[int, int]], run_start: int, end: int) -> int:
    """Close the run at ``end`` when a comma follows it (else the run goes on); the next run's start."""
    comma = _COMMA.match(raw, end)
    if comma is None:
        return run_start
    runs.append((run_start, end))
    return comma.end()


def _assemble(raw: bytes, splits: list[_Split]) -> Any:
    """The parsed body from its skeleton and runs; None when any piece is refused or empty."""
    skeleton_parts, last = [], 0
    for _, opened, closed, _runs in splits:
        skeleton_parts += [raw[last:opened + 1], raw[closed:closed + 1]]
        last = closed + 1
    skeleton_parts.append(raw[last:])
    try:
        body = orjson.loads(b"".join(skeleton_parts))
        if not isinstance(body, dict):
            return None
        for key, _, _, runs in splits:
            if body.get(key) != []:
                return None
            items: list[Any] = []
            for start, end in runs:
                part = orjson.loads(b"[" + raw[start:end] + b"]")
                if not part:  # an empty run: a stray comma
                    return None
                items.extend(part)
            body[key] = items
    except orjson.JSONDecodeError:
        return None
    return body
