"""SchemaRegistry: the compiled PML schemas of one engine, kept apart per cache salt.

A schema registered under one cache salt is invisible under every other: the
namespace is the salt (None, no salt, is a namespace of its own), so tenants behind
the gateway, whose salts the gateway derives, can neither use, list nor delete each
other's schemas. Module KV is keyed by the salt too (in the engine), so they cannot
time them either.

Bounds: at most ``max_schemas`` schemas and ``max_tokens`` module tokens per salt
(refused: :class:`RegistryFull` with ``per_salt`` True), and, engine-wide, at most
``max_salts`` salts holding schemas and ``max_total_tokens`` module tokens.

The engine-wide bounds are shared fairly between *owners*. A salt's owner is the
tenant that created its namespace (the gateway's ``x-prefixgate-tenant`` header),
or the salt itself when no tenant was named; one tenant varying its client salt
thus stays one owner. When a registration would pass an engine-wide bound, the
registry evicts from the other owner holding the most (salts for the salt bound,
tokens for the token bound; its oldest salt or schema first) as long as that owner
would still hold strictly more than the registering owner; otherwise it refuses
(``per_salt`` False). So a full registry never refuses an owner below its fair
share while another holds more, and an owner filling the engine alone loses its
oldest schemas, not its neighbours' (max-min fairness). Nothing is evicted by a
registration that is refused. An evicted schema is simply gone: a prompt naming
it gets "unknown schema" until it is registered again.

Registering an existing name replaces that schema (its tokens are counted once).
Thread-safe; no method but :meth:`put` and :meth:`delete` changes the registry.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Hashable

from engine.promptcache.pml_schema import CompiledSchema

DEFAULT_MAX_SCHEMAS = 64
DEFAULT_MAX_TOKENS = 262144
DEFAULT_MAX_SALTS = 1024
DEFAULT_MAX_TOTAL_TOKENS = 4 * 1024 * 1024  # all salts together: about 150 MiB of Python ints

Owner = Hashable


class RegistryFull(Exception):
    """A registration refused by a bound; ``per_salt`` is False when an engine-wide
    bound (salts or tokens) is full and the registering owner already holds its share."""

    def __init__(self, message: str, per_salt: bool) -> None:
        super().__init__(message)
        self.per_salt = per_salt


def owner_key(tenant: str | None, salt: str | None) -> Owner:
    """Who a new namespace belongs to: the named tenant, else its salt alone."""
    return ("tenant", tenant) if tenant else ("salt", salt)


class SchemaRegistry:
    """Compiled schemas by (cache salt, name); see the module docstring."""

    def __init__(self, *, max_schemas: int = DEFAULT_MAX_SCHEMAS, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_salts: int = DEFAULT_MAX_SALTS, max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS) -> None:
        self.max_schemas = max_schemas
        self.max_tokens = max_tokens
        self.max_salts = max_salts
        self.max_total_tokens = max_total_tokens
        self.total_tokens = 0
        self.evicted = 0  # schemas evicted to make room for another owner's
        self._by_salt: dict[str | None, dict[str, CompiledSchema]] = {}  # oldest namespace first
        self._owner_of: dict[str | None, Owner] = {}
        self._lock = threading.Lock()

    def put(self, salt: str | None, schema: CompiledSchema, tenant: str | None = None) -> None:
        """Register ``schema`` under ``salt`` (replacing one of the same name), evicting other
        owners' schemas when the engine is full and they hold more; RegistryFull when refused.
        ``tenant`` names the owner of a namespace this call creates."""
        with self._lock:
            current = self._by_salt.get(salt, {})
            others = [s for name, s in current.items() if name != schema.name]
            if len(others) >= self.max_schemas:
                raise RegistryFull(f"at most {self.max_schemas} schemas per cache salt; delete one first "
                                   "(DELETE /v1/prompt_schemas/{name})", per_salt=True)
            tokens = sum(s.total_tokens for s in others) + schema.total_tokens
            if tokens > self.max_tokens:
                raise RegistryFull(f"the schemas of this cache salt would hold {tokens} tokens, more than "
                                   f"{self.max_tokens}; delete one first", per_salt=True)
            owner = self._owner_of.get(salt) or owner_key(tenant, salt)
            replaced = current.get(schema.name)
            added = schema.total_tokens - (replaced.total_tokens if replaced else 0)
            for victim_salt, name in self._victims(owner, salt not in self._by_salt, added):
                self._remove(victim_salt, name)
                self.evicted += 1
            self._by_salt.setdefault(salt, {})[schema.name] = schema
            self._owner_of.setdefault(salt, owner)
            self.total_tokens += added

    def _victims(self, owner: Owner, new_salt: bool, added: int) -> list[tuple[str | None, str]]:
        """The (salt, name) pairs to evict so that ``owner`` may add ``added`` tokens (and a
        salt when ``new_salt``); RegistryFull when fairness allows no such eviction. Changes nothing."""
        salts: Counter[Owner] = Counter(self._owner_of.values())
        tokens: Counter[Owner] = Counter()
        queues: dict[Owner, deque[tuple[str | None, str, int]]] = {}
        for salt, schemas in self._by_salt.items():
            o = self._owner_of[salt]
            tokens[o] += sum(s.total_tokens for s in schemas.values())
            queues.setdefault(o, deque()).extend((salt, name, s.total_tokens) for name, s in schemas.items())
        salts[owner] += new_salt
        tokens[owner] += added
        held_salts, total = len(self._by_salt) + new_salt, self.total_tokens + added
        victims: list[tuple[str | None, str]] = []

        def heaviest(by: Counter[Owner], held: str) -> Owner:
            """The rival holding the most by ``by``, when it holds more than ``owner``; else refused."""
            rivals = [o for o in by if o != owner and queues.get(o)]
            top = max(rivals, key=lambda o: by[o], default=None)
            if top is None or by[top] <= by[owner]:
                raise RegistryFull(f"the engine holds {held} of schemas already and no owner holds more than "
                                   "yours; try again after some are deleted", per_salt=False)
            return top

        while held_salts > self.max_salts:
            rival = heaviest(salts, f"{self.max_salts} cache salts")
            salt = queues[rival][0][0]
            while queues[rival] and queues[rival][0][0] == salt:
                _, name, size = queues[rival].popleft()
                victims.append((salt, name))
                tokens[rival] -= size
                total -= size
            salts[rival] -= 1
            held_salts -= 1
        while total > self.max_total_tokens:
            rival = heaviest(tokens, f"{self.max_total_tokens} tokens")
            salt, name, size = queues[rival].popleft()
            victims.append((salt, name))
            tokens[rival] -= size
            total -= size
        return victims

    def _remove(self, salt: str | None, name: str) -> CompiledSchema | None:
        schemas = self._by_salt.get(salt)
        removed = schemas.pop(name, None) if schemas is not None else None
        if schemas is None or removed is None:
            return None
        self.total_tokens -= removed.total_tokens
        if not schemas:
            del self._by_salt[salt]
            del self._owner_of[salt]
        return removed

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
            return self._remove(salt, name) is not None

    def owner_usage(self) -> dict[Owner, tuple[int, int]]:
        """(salts, tokens) held per owner."""
        with self._lock:
            usage: dict[Owner, tuple[int, int]] = {}
            for salt, schemas in self._by_salt.items():
                n, t = usage.get(self._owner_of[salt], (0, 0))
                usage[self._owner_of[salt]] = (n + 1, t + sum(s.total_tokens for s in schemas.values()))
            return usage

    def check_integrity(self) -> None:
        """Every bound holds; no salt keeps an empty namespace; every namespace has one owner."""
        with self._lock:
            assert len(self._by_salt) <= self.max_salts
            assert self._owner_of.keys() == self._by_salt.keys()
            assert self.total_tokens == sum(s.total_tokens for d in self._by_salt.values() for s in d.values())
            assert self.total_tokens <= self.max_total_tokens
            for schemas in self._by_salt.values():
                assert schemas and len(schemas) <= self.max_schemas
                assert sum(s.total_tokens for s in schemas.values()) <= self.max_tokens
                assert all(name == s.name for name, s in schemas.items())
