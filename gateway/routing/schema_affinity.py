"""SchemaAffinity: the home replica of a PML prompt, by a consistent hash of its schema.

A completion with ``"prompt_format": "pml"`` names a schema
(``<prompt schema="rag">...``) whose modules the engine compiles into tokens the
gateway never sees: block keys computed from the markup text would predict hits
that cannot happen. Such a request is routed by its *affinity key* instead,
``SHA-256(cache salt, NUL, schema name)``: the salt the gateway derived is the
tenant's schema namespace, so two tenants' schemas of one name have different keys.
Each replica ``r`` scores ``SHA-256(key, r.name)`` (rendezvous hashing) and the
highest-scoring candidate is the schema's *home*, where its module KV stays warm;
adding or removing a replica moves only the schemas whose home it was.

:class:`gateway.routing.router.Router` charges every other replica
``miss_weight * tokens`` (the schema's module tokens, which it would compute
again), exactly as it charges a missed prefix, so a schema leaves its home only
under real queueing. The tokens come from the engine's answer to the schema's
registration through this gateway (:meth:`registered`), else
:data:`DEFAULT_SCHEMA_TOKENS`. A prompt that does not parse, or names no schema,
has no affinity (routed by load; the engine answers its 400).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any

from engine.promptcache.pml_syntax import PmlError, parse_pml

DEFAULT_SCHEMA_TOKENS = 512
MAX_KNOWN_SCHEMAS = 65536


@dataclass(frozen=True)
class Affinity:
    """One request's affinity: ``key`` (bytes) and the ``tokens`` a replica other than its home recomputes."""

    key: bytes
    tokens: int

    def score(self, replica_name: str) -> bytes:
        return hashlib.sha256(self.key + replica_name.encode("utf-8")).digest()


def affinity_key(salt: str | None, schema: str) -> bytes:
    return hashlib.sha256((salt or "").encode("utf-8") + b"\x00" + schema.encode("utf-8")).digest()


class SchemaAffinity:
    """The affinity of PML requests, and the module tokens of the schemas registered through the gateway."""

    def __init__(self) -> None:
        self._tokens: dict[bytes, int] = {}  # affinity key -> module tokens, oldest first
        self._lock = threading.Lock()  # of() runs in a worker thread

    def registered(self, salt: str | None, schema: str, tokens: int) -> None:
        with self._lock:
            key = affinity_key(salt, schema)
            self._tokens.pop(key, None)
            self._tokens[key] = tokens
            if len(self._tokens) > MAX_KNOWN_SCHEMAS:
                del self._tokens[next(iter(self._tokens))]

    def deleted(self, salt: str | None, schema: str) -> None:
        with self._lock:
            self._tokens.pop(affinity_key(salt, schema), None)

    def of(self, endpoint: str, body: dict[str, Any]) -> Affinity | None:
        """The affinity of an upstream ``body`` (its salt already the gateway's), None when it has none."""
        prompt = body.get("prompt")
        if endpoint != "completions" or body.get("prompt_format") != "pml" or not isinstance(prompt, str):
            return None
        try:
            schema = parse_pml(prompt).attrs.get("schema")
        except PmlError:
            return None
        if not schema:
            return None
        salt = body.get("cache_salt")
        key = affinity_key(salt if isinstance(salt, str) else None, schema)
        with self._lock:
            return Affinity(key, self._tokens.get(key, DEFAULT_SCHEMA_TOKENS))
