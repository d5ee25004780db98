"""The kind of server behind the gateway, and the cache-routing fields each kind gets.

Three kinds (``--upstream-kind``, ``[server] upstream_kind``):

* ``vllm`` (the default): vLLM, SGLang, prefixgate's own engine. The body carries
  ``cache_salt = derive_cache_salt(secret, scope, client salt)`` (see
  :mod:`gateway.policy.salt`); a cache salt keeps tenants' KV blocks apart. All three
  honour it: prefixgate's engine and vLLM hash it into the first block's key;
  SGLang (since its PR 10645, 2025) turns ``cache_salt`` into the ``extra_key`` its
  radix cache keys prefixes under.
* ``llamacpp``: llama.cpp's ``llama-server``. It ignores ``cache_salt`` (its slots
  reuse any earlier prompt), so it cannot keep tenants apart: the gateway sends no
  salt, and refuses to start when a tenant needs isolation unless the operator
  passes ``--allow-shared-cache`` (:func:`check_isolation`). Its usage is mapped to
  OpenAI's (:func:`openai_usage`: ``timings.cache_n`` as ``cached_tokens`` when the
  usage lacks them).
* ``openai``: OpenAI's hosted API, which rejects parameters it does not know
  (``cache_salt`` among them) and routes cached prefixes by ``prompt_cache_key``.
  The gateway never sends ``cache_salt`` there; it sends
  ``prompt_cache_key = "pg-" + HMAC(secret, scope || 0x00 || "prompt_cache_key" ||
  0x00 || family [|| 0x00 || client value])[:32 hex]`` and drops any client
  ``prompt_cache_key`` (or ``cache_salt``) from the body, folding it into the
  derivation instead, as salts do: a client value only narrows its own scope.

Invariants: the derivation goes through :func:`gateway.policy.salt.derive_cache_salt`
(one HMAC scheme, unambiguous because scopes and the family's JSON hold no NUL),
so two tenants with different isolation scopes never share a key, whatever
they send; the family is the linter's (model + masked leading instructions), so
requests that should share a prefix share a key.

Autodetection (no kind given): ``openai`` for ``api.openai.com``, else ``vllm``.

Stateful Responses (``previous_response_id``) are expanded by the gateway for every
kind (:mod:`gateway.responses.store`); upstreams always get ``store: false``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.config.config_file import UPSTREAM_KINDS, Tenant
from gateway.policy.salt import derive_cache_salt

OPENAI_HOSTS = frozenset({"api.openai.com"})
CACHE_KEY_FIELD = "prompt_cache_key"
CACHE_KEY_PREFIX = "pg-"
CACHE_KEY_HEX_CHARS = 32  # 128 bits
API_KEY_ENV = "PREFIXGATE_UPSTREAM_API_KEY"


ISOLATING_KINDS = frozenset({"vllm", "openai"})  # kinds whose cache is keyed per tenant
SHARED_CACHE_FLAG = "--allow-shared-cache"


def check_isolation(kind: str, tenants: Iterable[Tenant], open_mode: bool, allow_shared: bool) -> str | None:
    """The problem with serving these tenants in front of ``kind``, or None.

    A kind that cannot keep caches apart (``llamacpp``) with a tenant whose isolation
    is not ``shared`` (open mode: every key is an isolated tenant) is a problem unless
    ``allow_shared`` (the operator accepts that all tenants share one cache)."""
    if kind in ISOLATING_KINDS or allow_shared:
        return None
    isolated = ["every open-mode tenant"] if open_mode else sorted(
        tenant.name for tenant in tenants if tenant.isolation != "shared")
    if not isolated:
        return None
    return (f"upstream kind {kind} ignores cache_salt, so it cannot isolate tenant(s) "
            f"{', '.join(isolated[:5])}{' ...' if len(isolated) > 5 else ''}: set their isolation to "
            f"'shared' or pass {SHARED_CACHE_FLAG} to let all tenants share the upstream's cache")


def openai_usage(kind: str, payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """The OpenAI-shaped usage of an upstream answer (chat or completions), or None
    when it equals ``payload["usage"]``. ``llamacpp``: ``timings.cache_n`` (the
    prompt tokens its slot reused) becomes ``prompt_tokens_details.cached_tokens``
    when the usage does not already carry them."""
    usage, timings = payload.get("usage"), payload.get("timings")
    if kind != "llamacpp" or not isinstance(usage, dict) or not isinstance(timings, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return None
    cached = timings.get("cache_n")
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        return None
    return {**usage, "prompt_tokens_details": {**(details if isinstance(details, dict) else {}),
                                               "cached_tokens": cached}}


def resolve_kind(kind: str | None, upstream_url: str) -> str:
    """The kind to use: ``kind`` when given (validated), else detected from the URL."""
    if kind is not None:
        if kind not in UPSTREAM_KINDS:
            raise ValueError(f"upstream kind must be one of {', '.join(UPSTREAM_KINDS)}, got {kind!r}")
        return kind
    host = (urlsplit(upstream_url).hostname or "").lower()
    return "openai" if host in OPENAI_HOSTS else "vllm"


def request_family(body: Mapping[str, Any]) -> bytes:
    """The request family as bytes: model + the masked leading system/developer texts."""
    from linter.api import family_key

    return orjson.dumps(family_key(body))


def prompt_cache_key(secret: bytes, scope: str | None, body: Mapping[str, Any], client_value: str | None) -> str:
    """The server-derived ``prompt_cache_key`` for a request of ``scope`` (see the module doc)."""
    message = CACHE_KEY_FIELD + "\x00" + request_family(body).decode("utf-8")
    if client_value is not None:
        message += "\x00" + client_value
    digest = derive_cache_salt(secret, scope, message)
    assert digest is not None  # a message is always given
    return CACHE_KEY_PREFIX + digest[:CACHE_KEY_HEX_CHARS]


def scoped_body(
    kind: str, body: Mapping[str, Any], secret: bytes, scope: str | None, client_salt: str | None
) -> dict[str, Any]:
    """A copy of ``body`` with the cache fields of ``kind``; ``body`` lacks the client's salt.

    ``vllm``: ``cache_salt`` derived from the scope and the client's salt (none for a
    shared tenant without one). ``openai``: no ``cache_salt``; on chat and Responses requests a
    ``prompt_cache_key`` derived from the scope, the family and the client's key or
    salt (legacy completions carry neither field: OpenAI does not list the key there).
    ``llamacpp``: neither field (it isolates nothing; see :func:`check_isolation`).
    """
    upstream_body = dict(body)
    if kind == "openai":
        client_key = upstream_body.pop(CACHE_KEY_FIELD, None)
        family_body = body
        if "input" in body and "messages" not in body:  # Responses: keyed like the chat it stands for
            from gateway.responses.body import chat_view

            family_body = chat_view(dict(body)) or {"model": body.get("model"), "messages": []}
        if "messages" in family_body:  # chat and Responses: the endpoints whose parameters include the key
            client_value = client_key if isinstance(client_key, str) else client_salt
            upstream_body[CACHE_KEY_FIELD] = prompt_cache_key(secret, scope, family_body, client_value)
        return upstream_body
    if kind not in ISOLATING_KINDS:  # it would ignore the salt: send none
        return upstream_body
    salt = derive_cache_salt(secret, scope, client_salt)
    if salt is not None:
        upstream_body["cache_salt"] = salt
    return upstream_body
