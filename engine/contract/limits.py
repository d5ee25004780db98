"""The limits the gateway, the engine and the linter enforce alike, each stated once.

* JSON nested deeper than :data:`MAX_JSON_DEPTH` levels is refused before anything walks
  it recursively (the chat template, the tool renderer, JSON encoders);
* a ``cache_salt`` is a non-empty string of at most :data:`MAX_CACHE_SALT_CHARS`
  characters (the engine request's own invariant, :mod:`engine.kvcache.request`);
* a KV cache block holds :data:`BLOCK_SIZE` tokens unless configured otherwise: the
  engine's default, the gateway's block keys and the linter's cache replay agree on it;
* request bodies are bounded by :class:`engine.contract.body_reader.BodyLimits`.
"""

from __future__ import annotations

from typing import Any

from engine.kvcache.request import MAX_CACHE_SALT_CHARS

__all__ = ["BLOCK_SIZE", "MAX_CACHE_SALT_CHARS", "MAX_JSON_DEPTH", "cache_salt_problem", "json_too_deep",
           "too_deep_field"]

MAX_JSON_DEPTH = 128
BLOCK_SIZE = 16


def json_too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``value`` nests objects/arrays more than ``limit`` levels deep.

    ``{}`` and ``[]`` are one level, a scalar zero. Walks level by level without
    recursion and stops as soon as the limit is passed, so a hostile body costs one
    pass over its containers at most.
    """
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        if not level:
            return False
        children: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            children.extend(item for item in items if isinstance(item, dict | list))
        level = children
    return bool(level)


def too_deep_field(body: dict[str, Any]) -> str | None:
    """The first field of ``body`` that takes the body past :data:`MAX_JSON_DEPTH` levels."""
    for name, value in body.items():
        if json_too_deep(value, MAX_JSON_DEPTH - 1):
            return str(name)
    return None


def cache_salt_problem(value: object) -> str | None:
    """Why ``value`` is not a valid ``cache_salt`` (one sentence for the 400), or None."""
    if isinstance(value, str) and value and len(value) <= MAX_CACHE_SALT_CHARS:
        return None
    got = f"a string of {len(value)} characters" if isinstance(value, str) else (
        "null" if value is None else type(value).__name__)
    return f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, got {got}."
