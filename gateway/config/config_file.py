"""The gateway's TOML configuration: server settings and tenants.

Invariants: tenant and group names match ``NAME_PATTERN`` (so a salt scope never
contains a NUL byte); every key hash is ``sha256:<64 hex>`` and belongs to exactly
one tenant; ``config is None`` at the call sites means open mode.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.contract.body_reader import BodyLimits
from gateway.config.replica_spec import (
    ReplicaSpec,
    RoutingOptions,
    parse_routing_table,
    parse_upstreams_table,
)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_HASH_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_INFLIGHT_BODY_BYTES = 128 * 1024 * 1024  # a request holds about 3x its body (bytes, parse, re-encoding)
DEFAULT_TENANT_INFLIGHT_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 120.0
DEFAULT_BODY_IDLE_TIMEOUT_S = 15.0
DEFAULT_INPUT_PRICE = 1.0
DEFAULT_CACHED_INPUT_PRICE = 0.1
UPSTREAM_KINDS = ("vllm", "openai", "llamacpp")


@dataclass(frozen=True)
class CanonicalizeSwitches:
    """Which canonicalization steps a tenant gets.

    On by default: the steps that cannot change an answer (docs/gateway.md, "Canonicalization").
    ``tool_order`` and ``tool_result_order`` are off by default: they reorder the tools
    and the messages, which the model reads in the order given (on the bundled model
    each changed a temperature-0 answer).
    ``canonicalize = true`` means these defaults, ``false`` turns every step off.
    """

    tools: bool = True
    tool_order: bool = False
    response_format: bool = True
    tool_call_arguments: bool = True
    tool_result_order: bool = False
    single_text_part: bool = True
    image_parts: bool = True

    @classmethod
    def from_value(cls, value: Any, where: str) -> CanonicalizeSwitches:
        if isinstance(value, bool):
            return cls() if value else cls(*(False,) * len(cls.__dataclass_fields__))
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a table or a boolean, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"{where}: unknown switch(es) {sorted(unknown)!r}")
        for key, flag in value.items():
            if not isinstance(flag, bool):
                raise ValueError(f"{where}.{key}: expected true/false, got {flag!r}")
        return cls(**dict(value))


@dataclass(frozen=True)
class Tenant:
    """A tenant: its cache isolation scope, canonicalization and warning policy."""

    name: str
    isolation: str = "isolated"  # "isolated" | "group:NAME" | "shared"
    canonicalize: CanonicalizeSwitches = field(default_factory=CanonicalizeSwitches)
    reject_on: frozenset[str] = frozenset()
    warnings: bool = True

    @property
    def scope(self) -> str | None:
        """The salt scope: ``tenant:NAME``, ``group:NAME`` or ``None`` for shared."""
        if self.isolation == "shared":
            return None
        if self.isolation.startswith("group:"):
            return self.isolation
        return f"tenant:{self.name}"


@dataclass(frozen=True)
class GatewayConfig:
    tenants: dict[str, Tenant] = field(default_factory=dict)
    key_hashes: dict[str, str] = field(default_factory=dict)  # key hash -> tenant name
    admin_key_hashes: frozenset[str] = frozenset()
    secret: str | None = None
    upstream: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Request bodies in flight (engine/contract/body_reader.py): bytes overall and per tenant, read timeouts.
    inflight_body_bytes: int = DEFAULT_INFLIGHT_BODY_BYTES
    tenant_inflight_body_bytes: int = DEFAULT_TENANT_INFLIGHT_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    body_idle_timeout_s: float = DEFAULT_BODY_IDLE_TIMEOUT_S
    upstream_timeout_s: float = 600.0  # total, per request
    upstream_idle_timeout_s: float = 15.0  # no byte this long: probe the replica (stall_watchdog.py)
    connect_timeout_s: float = 5.0
    upstream_kind: str | None = None  # None: detected from the upstream URL
    # The dashboard's cost estimate, in any currency per million prompt tokens.
    input_price_per_million: float = DEFAULT_INPUT_PRICE
    cached_input_price_per_million: float = DEFAULT_CACHED_INPUT_PRICE
    upstreams: tuple[ReplicaSpec, ...] = ()  # [[upstreams]]: several replicas (gateway/config/replica_spec.py)
    routing: RoutingOptions = field(default_factory=RoutingOptions)  # [routing]

    def body_limits(self) -> BodyLimits:
        return BodyLimits(
            max_bytes=self.max_body_bytes, inflight_bytes=self.inflight_body_bytes,
            tenant_inflight_bytes=self.tenant_inflight_body_bytes,
            timeout_s=self.body_timeout_s, idle_timeout_s=self.body_idle_timeout_s,
        )


def parse_isolation(value: Any, where: str) -> str:
    if value in ("isolated", "shared"):
        return str(value)
    if isinstance(value, str) and value.startswith("group:") and NAME_PATTERN.match(value[6:]):
        return value
    raise ValueError(f"{where}: isolation must be 'isolated', 'shared' or 'group:NAME', got {value!r}")


def _key_hashes(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: expected a list of 'sha256:<hex>' strings, got {value!r}")
    for item in value:
        if not KEY_HASH_PATTERN.match(item):
            raise ValueError(f"{where}: not a key hash (run 'prefixgate keys create'): {item!r}")
    return list(value)


def _number(table: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{where}.{key}: expected a positive number, got {value!r}")
    return float(value)


def parse_tenant(name: str, table: Any) -> tuple[Tenant, list[str]]:
    where = f"tenants.{name}"
    if not NAME_PATTERN.match(name):
        raise ValueError(f"{where}: invalid tenant name {name!r}")
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    known = {"keys", "isolation", "canonicalize", "reject_on", "warnings"}
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)!r}")
    reject_on = table.get("reject_on", [])
    if not isinstance(reject_on, list) or not all(isinstance(c, str) for c in reject_on):
        raise ValueError(f"{where}.reject_on: expected a list of rule codes, got {reject_on!r}")
    warnings = table.get("warnings", True)
    if not isinstance(warnings, bool):
        raise ValueError(f"{where}.warnings: expected true/false, got {warnings!r}")
    tenant = Tenant(
        name=name,
        isolation=parse_isolation(table.get("isolation", "isolated"), f"{where}.isolation"),
        canonicalize=CanonicalizeSwitches.from_value(
            table.get("canonicalize", True), f"{where}.canonicalize"
        ),
        reject_on=frozenset(code.upper() for code in reject_on),
        warnings=warnings,
    )
    return tenant, _key_hashes(table.get("keys", []), f"{where}.keys")


def parse_config(data: Mapping[str, Any]) -> GatewayConfig:
    """Build a :class:`GatewayConfig` from parsed TOML; ``ValueError`` names the bad field."""
    unknown = set(data) - {"server", "tenants", "upstreams", "routing"}
    if unknown:
        raise ValueError(f"unknown top-level table(s) {sorted(unknown)!r}")
    server = data.get("server", {})
    if not isinstance(server, Mapping):
        raise ValueError(f"server: expected a table, got {server!r}")
    tenants: dict[str, Tenant] = {}
    key_hashes: dict[str, str] = {}
    raw_tenants = data.get("tenants", {})
    if not isinstance(raw_tenants, Mapping):
        raise ValueError(f"tenants: expected a table, got {raw_tenants!r}")
    for name, table in raw_tenants.items():
        tenant, hashes = parse_tenant(name, table)
        tenants[name] = tenant
        for key_hash in hashes:
            if key_hash in key_hashes:
                raise ValueError(f"tenants.{name}.keys: key {key_hash} already belongs to {key_hashes[key_hash]!r}")
            key_hashes[key_hash] = name
    secret = server.get("secret")
    if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
        raise ValueError("server.secret: expected a string of at least 16 characters")
    upstream = server.get("upstream")
    if upstream is not None and not isinstance(upstream, str):
        raise ValueError(f"server.upstream: expected a URL string, got {upstream!r}")
    upstream_kind = server.get("upstream_kind")
    if upstream_kind is not None and upstream_kind not in UPSTREAM_KINDS:
        raise ValueError(f"server.upstream_kind: expected one of {list(UPSTREAM_KINDS)}, got {upstream_kind!r}")
    input_price = _number(server, "input_price_per_million", DEFAULT_INPUT_PRICE, "server")
    cached_price = server.get("cached_input_price_per_million", DEFAULT_CACHED_INPUT_PRICE)
    if isinstance(cached_price, bool) or not isinstance(cached_price, int | float) or not 0 <= cached_price <= input_price:
        raise ValueError(
            f"server.cached_input_price_per_million: expected a number from 0 to input_price_per_million, "
            f"got {cached_price!r}"
        )
    return GatewayConfig(
        tenants=tenants,
        key_hashes=key_hashes,
        admin_key_hashes=frozenset(_key_hashes(server.get("admin_keys", []), "server.admin_keys")),
        secret=secret,
        upstream=upstream,
        max_body_bytes=int(_number(server, "max_body_bytes", DEFAULT_MAX_BODY_BYTES, "server")),
        inflight_body_bytes=int(_number(server, "inflight_body_bytes", DEFAULT_INFLIGHT_BODY_BYTES, "server")),
        tenant_inflight_body_bytes=int(
            _number(server, "tenant_inflight_body_bytes", DEFAULT_TENANT_INFLIGHT_BODY_BYTES, "server")
        ),
        body_timeout_s=_number(server, "body_timeout_s", DEFAULT_BODY_TIMEOUT_S, "server"),
        body_idle_timeout_s=_number(server, "body_idle_timeout_s", DEFAULT_BODY_IDLE_TIMEOUT_S, "server"),
        upstream_timeout_s=_number(server, "upstream_timeout_s", 600.0, "server"),
        upstream_idle_timeout_s=_number(server, "upstream_idle_timeout_s", 15.0, "server"),
        connect_timeout_s=_number(server, "connect_timeout_s", 5.0, "server"),
        upstream_kind=upstream_kind,
        input_price_per_million=input_price,
        cached_input_price_per_million=float(cached_price),
        upstreams=parse_upstreams_table(data["upstreams"]) if "upstreams" in data else (),
        routing=parse_routing_table(data.get("routing", {})),
    )


def load_config(path: Path) -> GatewayConfig:
    """The config in ``path``; ``ValueError`` (one line) for a missing, unreadable or bad file."""
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the config file: {exc.strerror or exc}") from exc
    try:
        return parse_config(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
