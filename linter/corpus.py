"""Reading request logs: JSON or JSONL files of chat-completions bodies or log records.

A record is a bare body (an object with ``messages``) or a log record holding the
body under ``request`` or ``body`` (an object or a JSON string). Each
:class:`Record` remembers where it came from so findings point at the file, the
record's line (for JSONL, the record's line; for a JSON array, the line where the
offending text appears) and a column. Unreadable records are reported as
:class:`LoadProblem` objects and skipped; they never stop a run.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

REQUEST_SUFFIXES = (".json", ".jsonl", ".ndjson")


@dataclass(frozen=True)
class LoadProblem:
    path: str
    line: int
    message: str


@dataclass
class Record:
    """One request body and its place in a file (``start`` is its offset in ``text``)."""

    path: str
    line: int
    body: Mapping[str, Any]
    text: str = field(repr=False)
    start: int
    end: int
    line_starts: list[int] = field(repr=False)

    def locate(self, needle: str | None) -> tuple[int, int]:
        """(line, column) of ``needle`` inside this record's text, else of the record start."""
        offset = self.start
        if needle:
            for form in (json.dumps(needle, ensure_ascii=False)[1:-1], json.dumps(needle)[1:-1], needle):
                found = self.text.find(form, self.start, self.end)
                if found >= 0:
                    offset = found
                    break
        line_index = bisect.bisect_right(self.line_starts, offset) - 1
        return line_index + 1, offset - self.line_starts[line_index] + 1


def extract_body(value: Any) -> Mapping[str, Any] | None:
    """The chat-completions body in a parsed record, or None."""
    if not isinstance(value, Mapping):
        return None
    if "messages" in value:
        return value
    for key in ("request", "body"):
        inner = value.get(key)
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except ValueError:
                continue
        if isinstance(inner, Mapping) and "messages" in inner:
            return inner
    return None


def _line_starts(text: str) -> list[int]:
    starts = [0]
    pos = text.find("\n")
    while pos >= 0:
        starts.append(pos + 1)
        pos = text.find("\n", pos + 1)
    return starts


def _json_values(text: str) -> Iterator[tuple[int, int, Any]]:
    """(start, end, value) for each element of a top-level array, or the one top-level value."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if text[pos : pos + 1] != "[":
        value, end = decoder.raw_decode(text, pos)
        yield pos, end, value
        return
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        value, end = decoder.raw_decode(text, pos)
        yield pos, end, value
        pos = end


def load_file(path: Path, problems: list[LoadProblem]) -> list[Record]:
    """Records of one file; problems are appended to ``problems``."""
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(LoadProblem(name, 1, f"cannot read file: {exc}"))
        return []
    starts = _line_starts(text)
    records: list[Record] = []
    if path.suffix in (".jsonl", ".ndjson"):
        for n, begin in enumerate(starts):
            end = starts[n + 1] - 1 if n + 1 < len(starts) else len(text)
            raw = text[begin:end].strip()
            if not raw:
                continue
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                problems.append(LoadProblem(name, n + 1, f"invalid JSON: {exc}"))
                continue
            _add(records, problems, name, value, text, begin, end, starts)
        return records
    try:
        for begin, end, value in _json_values(text):
            _add(records, problems, name, value, text, begin, end, starts)
    except ValueError as exc:
        problems.append(LoadProblem(name, 1, f"invalid JSON: {exc}"))
    return records


def _add(records: list[Record], problems: list[LoadProblem], name: str, value: Any, text: str, begin: int, end: int, starts: list[int]) -> None:
    line = bisect.bisect_right(starts, begin)
    body = extract_body(value)
    if body is None:
        problems.append(LoadProblem(name, line, "not a chat-completions request (no 'messages', 'request' or 'body')"))
        return
    records.append(Record(name, line, body, text, begin, end, starts))
