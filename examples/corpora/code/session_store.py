"""Conversation memory the way libraries keep it: sessions, windows and compaction (labelled)."""

from __future__ import annotations

import sqlite3
from typing import Any


class InMemorySession:
    """Stores the items of one conversation; ``get_items`` is what the next request sends."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._items: list[dict[str, Any]] = []

    def add_items(self, items: list[dict[str, Any]]) -> None:
        self._items.extend(items)

    def get_items(self, limit: int | None = None) -> list[dict[str, Any]]:
        if limit is None:
            return list(self._items)
        return self._items[-limit:]  # expect: PS305

    def pop_item(self) -> dict[str, Any] | None:
        return self._items.pop() if self._items else None


class SqliteSession:
    def __init__(self, path: str, session_id: str) -> None:
        self.db = sqlite3.connect(path)
        self.session_id = session_id

    def get_items(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT role, content FROM items WHERE session = ? ORDER BY id", (self.session_id,)).fetchall()
        items = [{"role": role, "content": content} for role, content in rows]
        return items[len(items) - limit :]  # expect: PS305


class Conversation:
    """Keeps a budget by dropping the oldest turn: every request then starts differently."""

    def __init__(self, system: str, budget: int) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.budget = budget

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        while len(self.messages) > self.budget:
            self.messages.pop(1)  # expect: PS305


class CompactingConversation:
    """Appends only; when full, replaces the old turns with one summary, once."""

    def __init__(self, system: str, budget: int) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.budget = budget

    def add(self, message: dict[str, Any], summarize: Any) -> None:
        self.messages.append(message)
        if len(self.messages) > self.budget:
            summary = summarize(self.messages[1:])
            self.messages = [self.messages[0], {"role": "user", "content": f"Summary so far: {summary}"}]

    def last_exchange(self) -> list[dict[str, Any]]:
        tail = self.messages[-2:]
        return [dict(m) for m in tail]

    def preview(self) -> str:
        return " / ".join(m["content"][:40] for m in self.messages[-3:])
