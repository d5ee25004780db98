"""SchemaRegistry: the compiled PML schemas of one engine, kept apart per cache salt.

A schema registered under one cache salt is invisible under every other: the
namespace is the salt (None, no salt, is a namespace of its own), so tenants behind
the gateway, whose salts the gateway derives, can neither use, list nor delete each
other's schemas. Module KV is keyed by the salt too (in the engine), so they cannot
time them either.

Bounded, and refusing rather than evicting (an eviction would let one tenant push
out another's schemas): at most ``max_schemas`` schemas and ``max_tokens`` module
tokens per salt, at most ``max_salts`` salts holding schemas and
``max_total_tokens`` module tokens in all;
:class:`RegistryFull` says which bound was hit. Registering an existing name
replaces that schema (its tokens are counted once). Thread-safe.
"""

from __future__ import annotations

import threading

from engine.promptcache.pml_schema import CompiledSchema

DEFAULT_MAX_SCHEMAS = 64
DEFAULT_MAX_TOKENS = 262144
DEFAULT_MAX_SALTS = 1024
DEFAULT_MAX_TOTAL_TOKENS = 4 * 1024 * 1024  # all salts together: about 150 MiB of Python ints


class RegistryFull(Exception):
    """A registration refused by a bound; ``per_salt`` is False when the whole
    registry (its number of salts) is full."""

    def __init__(self, message: str, per_salt: bool) -> None:
        super().__init__(message)
        self.per_salt = per_salt


class SchemaRegistry:
    """Compiled schemas by (cache salt, name); see the module docstring."""

    def __init__(self, *, max_schemas: int = DEFAULT_MAX_SCHEMAS, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_salts: int = DEFAULT_MAX_SALTS, max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS) -> None:
        self.max_schemas = max_schemas
        self.max_tokens = max_tokens
        self.max_salts = max_salts
        self.max_total_tokens = max_total_tokens
        self.total_tokens = 0
        self._by_salt: dict[str | None, dict[str, CompiledSchema]] = {}
        self._lock = threading.Lock()

    def put(self, salt: str | None, schema: CompiledSchema) -> None:
        """Register ``schema`` under ``salt`` (replacing one of the same name); RegistryFull past a bound."""
        with self._lock:
            schemas = self._by_salt.get(salt)
            if schemas is None and len(self._by_salt) >= self.max_salts:
                raise RegistryFull(f"the engine holds schemas for {self.max_salts} cache salts already; "
                                   "try again after some are deleted", per_salt=False)
            current = schemas or {}
            others = [s for name, s in current.items() if name != schema.name]
            if len(others) >= self.max_schemas:
                raise RegistryFull(f"at most {self.max_schemas} schemas per cache salt; delete one first "
                                   "(DELETE /v1/prompt_schemas/{name})", per_salt=True)
            tokens = sum(s.total_tokens for s in others) + schema.total_tokens
            if tokens > self.max_tokens:
                raise RegistryFull(f"the schemas of this cache salt would hold {tokens} tokens, more than "
                                   f"{self.max_tokens}; delete one first", per_salt=True)
            replaced = current.get(schema.name)
            total = self.total_tokens - (replaced.total_tokens if replaced else 0) + schema.total_tokens
            if total > self.max_total_tokens:
                raise RegistryFull(f"the engine holds {self.max_total_tokens} tokens of schemas already; "
                                   "try again after some are deleted", per_salt=False)
            self._by_salt.setdefault(salt, {})[schema.name] = schema
            self.total_tokens = total

    def get(self, salt: str | None, name: str) -> CompiledSchema | None:
        with self._lock:
            return self._by_salt.get(salt, {}).get(name)

    def list(self, salt: str | None) -> list[CompiledSchema]:
        """The schemas of ``salt``, in registration order."""
        with self._lock:
            return list(self._by_salt.get(salt, {}).values())

    def delete(self, salt: str | None, name: str) -> bool:
        """Remove a schema; False when ``salt`` has none of that name."""
        with self._lock:
            schemas = self._by_salt.get(salt)
            removed = schemas.pop(name, None) if schemas is not None else None
            if schemas is None or removed is None:
                return False
            self.total_tokens -= removed.total_tokens
            if not schemas:
                del self._by_salt[salt]
            return True

    def check_integrity(self) -> None:
        """Every bound holds; no salt keeps an empty namespace."""
        with self._lock:
            assert len(self._by_salt) <= self.max_salts
            assert self.total_tokens == sum(s.total_tokens for d in self._by_salt.values() for s in d.values())
            assert self.total_tokens <= self.max_total_tokens
            for schemas in self._by_salt.values():
                assert schemas and len(schemas) <= self.max_schemas
                assert sum(s.total_tokens for s in schemas.values()) <= self.max_tokens
                assert all(name == s.name for name, s in schemas.items())
