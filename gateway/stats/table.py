"""The ``request_log`` table: exactly one row per proxied inference request.

Columns (the linter reads this table, keep them stable):

- ``time``: UTC time the request arrived (naive UTC datetime);
- ``tenant``: the tenant name, NULL when the request was not authenticated (401);
- ``endpoint``: ``chat.completions`` or ``completions``;
- ``model``: the requested model, NULL when the body had none or was unreadable;
- ``upstream``: the upstream base URL;
- ``status``: the HTTP status the client got (499: the client disconnected first);
- ``stream``: whether the client asked for streaming;
- ``prompt_tokens``, ``completion_tokens``: from the upstream's usage, NULL if absent;
- ``cached_tokens``: ``usage.prompt_tokens_details.cached_tokens``; NULL means
  *unknown* (the upstream did not report it), never silently 0;
- ``ttft_ms``: time to the first SSE event (stream) or to the upstream's complete
  answer (non-stream); ``latency_ms``: until the response was handed to the server;
- ``warning_codes``, ``canonicalization``: comma-separated, sorted, unique codes /
  step names in the order applied ("" when none);
- ``error_code``: the OpenAI error ``code`` for failed requests, else NULL;
- ``replica``: the name of the replica that got the request (``r0``, ``r1``... or
  the configured name; after a retry the one that answered), NULL when the
  request never reached the routing step;
- ``predicted_cached_tokens``: the cached tokens the gateway predicted from its
  block index when it routed the request (multiple of the block size), NULL when
  it could not compute the request's block keys (single upstream, no tokenizer,
  images).
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

request_log = Table(
    "request_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("time", DateTime, nullable=False),
    Column("tenant", String(128), nullable=True),
    Column("endpoint", String(32), nullable=False),
    Column("model", String(256), nullable=True),
    Column("upstream", String(512), nullable=False),
    Column("status", Integer, nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("prompt_tokens", Integer, nullable=True),
    Column("cached_tokens", Integer, nullable=True),
    Column("completion_tokens", Integer, nullable=True),
    Column("ttft_ms", Float, nullable=True),
    Column("latency_ms", Float, nullable=False),
    Column("warning_codes", Text, nullable=False, default=""),
    Column("canonicalization", Text, nullable=False, default=""),
    Column("error_code", String(64), nullable=True),
    Column("replica", String(64), nullable=True),
    Column("predicted_cached_tokens", Integer, nullable=True),
    Index("ix_request_log_tenant_time", "tenant", "time"),
)
