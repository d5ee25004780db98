"""unsatisfiable: a JSON schema that no finite JSON value can satisfy, found before any grammar.

A grammar compiled from such a schema (an object that requires a property whose
schema is the object itself, directly or through ``$ref``s) has no finite
sentence: llguidance accepts it, and the request then fails mid-generation when
its forced prefix grows past the parser's limits. This check finds the common
shapes up front so the request is a 400 naming the schema.

The check is conservative: it answers a reason only when the schema surely has
no finite instance, and None whenever it cannot tell (``anyOf`` with a branch it
cannot decide, types it does not reason about, ``$ref`` outside the document).
It never mutates the schema and does bounded work: each ``$ref`` target is
entered at most once per path, and the walk stops at :data:`MAX_DEPTH`.

A schema is surely unsatisfiable here when it is ``false``; when it admits only
objects and one of its ``required`` properties is surely unsatisfiable (or is
not declared while ``additionalProperties`` is ``false``); when it admits only
arrays, requires ``minItems >= 1`` and its ``items`` are surely unsatisfiable;
when every ``anyOf``/``oneOf`` branch, or one ``allOf`` member, is; and when a
``$ref`` leads back to a schema already being proven along the same path (the
value would have to contain itself).
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64


def unsatisfiable(schema: Any) -> str | None:
    """Why ``schema`` has no finite instance, or None when it may have one."""
    return _Walk(schema).why(schema, (), 0, "#")


class _Walk:
    def __init__(self, root: Any) -> None:
        self.root = root

    def why(self, schema: Any, refs: tuple[str, ...], depth: int, where: str) -> str | None:
        if schema is False:
            return f"{where} is false"
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return None
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in refs:
                return f"{where} requires a value containing itself ($ref {ref!r})"
            target = self._resolve(ref)
            if target is not None:
                reason = self.why(target, (*refs, ref), depth + 1, ref)
                if reason is not None:
                    return reason
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                reasons = [self.why(b, refs, depth + 1, f"{where}/{key}/{i}")
                           for i, b in enumerate(branches)]
                if all(r is not None for r in reasons):
                    return reasons[0]
        members = schema.get("allOf")
        if isinstance(members, list):
            for i, member in enumerate(members):
                reason = self.why(member, refs, depth + 1, f"{where}/allOf/{i}")
                if reason is not None:
                    return reason
        kinds = _only_type(schema)
        if kinds == "object":
            return self._object(schema, refs, depth, where)
        if kinds == "array":
            return self._array(schema, refs, depth, where)
        return None

    def _object(self, schema: dict[str, Any], refs: tuple[str, ...], depth: int,
                where: str) -> str | None:
        required = schema.get("required")
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        for name in required if isinstance(required, list) else ():
            if not isinstance(name, str):
                continue
            if name in properties:
                reason = self.why(properties[name], refs, depth + 1, f"{where}/properties/{name}")
                if reason is not None:
                    return reason
            elif schema.get("additionalProperties") is False:
                return f"{where} requires {name!r}, which additionalProperties: false forbids"
        return None

    def _array(self, schema: dict[str, Any], refs: tuple[str, ...], depth: int,
               where: str) -> str | None:
        least = schema.get("minItems")
        if not isinstance(least, int) or least < 1 or "prefixItems" in schema:
            return None
        return self.why(schema.get("items"), refs, depth + 1, f"{where}/items")

    def _resolve(self, ref: str) -> Any:
        """The schema a local ``#/...`` pointer names, or None."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for raw in ref[1:].split("/")[1:] if ref != "#" else []:
            part = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def _only_type(schema: dict[str, Any]) -> str | None:
    """"object" or "array" when ``schema`` admits values of that one JSON type only."""
    kind = schema.get("type")
    if isinstance(kind, list) and len(kind) == 1:
        kind = kind[0]
    return kind if kind in ("object", "array") else None
