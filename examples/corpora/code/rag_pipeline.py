"""Retrieval-augmented answers: instructions, retrieved passages and tracing (labelled)."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

ANSWER_RULES = "Answer only from the passages. Quote the passage id for every claim. Say 'not found' otherwise."
SOURCES = {"handbook", "wiki", "tickets"}


@dataclass
class Passage:
    id: str
    source: str
    text: str


def cache_buster() -> str:
    return hashlib.sha1(str(time.time()).encode()).hexdigest()[:8]  # expect: PS301


def build_request(question: str, passages: list[Passage]) -> dict[str, Any]:
    trace_id = uuid.uuid4().hex  # expect: PS301
    sources = ", ".join(SOURCES)  # expect: PS303
    developer = f"{ANSWER_RULES}\nSearchable sources: {sources}\nTrace: {trace_id} v={cache_buster()}"
    context = "\n\n".join(f"[{p.id}] ({p.source}) {p.text}" for p in passages)
    return {
        "model": "gpt-4.1-mini",
        "messages": [
            {"role": "developer", "content": developer},
            {"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {question}"},
        ],
    }


def build_request_cache_friendly(question: str, passages: list[Passage]) -> dict[str, Any]:
    sources = ", ".join(sorted(SOURCES))
    context = "\n\n".join(f"[{p.id}] ({p.source}) {p.text}" for p in passages)
    return {
        "model": "gpt-4.1-mini",
        "messages": [
            {"role": "developer", "content": f"{ANSWER_RULES}\nSearchable sources: {sources}"},
            {"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {question}\n(trace {uuid.uuid4().hex})"},
        ],
        "metadata": {"trace_id": uuid.uuid4().hex, "started": str(time.time())},
    }


def dedupe(passages: list[Passage]) -> list[Passage]:
    seen: set[str] = set()
    kept = []
    for passage in passages:
        if passage.id not in seen:
            seen.add(passage.id)
            kept.append(passage)
    return kept
