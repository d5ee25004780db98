"""SchemaQuota: how many prompt-schema namespaces one tenant may hold through this gateway.

Every distinct client ``cache_salt`` a tenant sends gives it a distinct server-side
salt (:func:`gateway.policy.salt.derive_cache_salt`), hence a distinct schema
namespace on the engine. Without a bound one tenant could, by varying its client
salt, open namespaces until the engine's registry is full. The quota allows a
tenant at most ``max_namespaces`` client salts (no salt counts as one) that hold
schemas registered through this gateway; registering under one more is refused
with 400 ``schema_limit`` (param ``cache_salt``) before any replica is asked. It
also allows a tenant at most ``max_tokens`` module tokens in all its namespaces: a
registration that takes it past them (known from the engine's answer) is refused
with 400 ``schema_limit`` (param ``pml``) and rolled back by the caller.

Bookkeeping is in this process's memory, by (tenant, client salt, schema name): a
namespace counts from the moment a registration under it starts (so concurrent
registrations cannot overshoot) until its last schema is deleted (a DELETE frees
the name whatever the engine answers, so a schema the engine evicted can be
released). It starts empty when the gateway starts; the engine's registry shares
its own bounds fairly between tenants behind that (see
:mod:`engine.promptcache.schema_registry`), so the quota is a first line, not the
only one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import InvalidRequest

DEFAULT_MAX_NAMESPACES = 16
DEFAULT_MAX_TOKENS = 1024 * 1024  # a quarter of one engine's registry (schema_registry.DEFAULT_MAX_TOTAL_TOKENS)


class SchemaQuota:
    def __init__(self, max_namespaces: int = DEFAULT_MAX_NAMESPACES, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_namespaces < 1:
            raise ValueError(f"max_namespaces must be >= 1, got {max_namespaces!r}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        self.max_namespaces = max_namespaces
        self.max_tokens = max_tokens
        self._names: dict[str, dict[str | None, dict[str, int]]] = {}  # tenant -> client salt -> name -> tokens
        self._pending: dict[tuple[str, str | None], int] = {}  # registrations under way per namespace

    def namespaces(self, tenant: str) -> int:
        """The namespaces ``tenant`` holds or is registering into."""
        held = self._names.get(tenant, {})
        return len(held.keys() | {salt for t, salt in self._pending if t == tenant})

    @contextmanager
    def registering(self, tenant: str, client_salt: str | None) -> Iterator[None]:
        """Reserve the namespace for one registration (InvalidRequest past the quota); call
        :meth:`registered` inside once it succeeded. Released on exit."""
        held = self._names.get(tenant, {})
        key = (tenant, client_salt)
        if client_salt not in held and key not in self._pending and self.namespaces(tenant) >= self.max_namespaces:
            raise InvalidRequest(f"a tenant may hold prompt schemas under at most {self.max_namespaces} distinct "
                                 "cache_salt values; delete the schemas of another one first",
                                 param="cache_salt", code="schema_limit")
        self._pending[key] = self._pending.get(key, 0) + 1
        try:
            yield
        finally:
            self._pending[key] -= 1
            if not self._pending[key]:
                del self._pending[key]

    def tokens(self, tenant: str) -> int:
        """The module tokens of the schemas ``tenant`` registered."""
        return sum(sum(names.values()) for names in self._names.get(tenant, {}).values())

    def registered(self, tenant: str, client_salt: str | None, name: str, tokens: int) -> None:
        """Record a registration the replicas accepted (replacing ``name``'s); InvalidRequest, and
        ``name`` forgotten, when the tenant then holds more than ``max_tokens``: the caller
        deletes it from the replicas."""
        self.deleted(tenant, client_salt, name)
        held = self.tokens(tenant)
        if held + tokens > self.max_tokens:
            raise InvalidRequest(f"this schema has {tokens} tokens and the tenant's other schemas {held}; a tenant "
                                 f"may hold at most {self.max_tokens}: delete some first",
                                 param="pml", code="schema_limit")
        self._names.setdefault(tenant, {}).setdefault(client_salt, {})[name] = tokens

    def deleted(self, tenant: str, client_salt: str | None, name: str) -> None:
        """Forget ``name`` in that namespace, and the namespace when it is then empty."""
        held = self._names.get(tenant, {})
        names = held.get(client_salt)
        if names is None:
            return
        names.pop(name, None)
        if not names:
            del held[client_salt]
        if not held:
            self._names.pop(tenant, None)

    def check_integrity(self) -> None:
        for tenant, held in self._names.items():
            assert held and all(held.values()), tenant
        assert all(count > 0 for count in self._pending.values())
