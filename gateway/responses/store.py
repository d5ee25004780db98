"""Stored Responses: the ``stored_response`` table and its tenant-scoped reads and writes.

A stored response is what the next turn of its conversation needs, kept as the
bytes that went upstream, never re-serialized:

* ``input_items``: the JSON array of input items the upstream got for this turn
  (the previous turn's ``input_items`` and ``output_items`` joined with this turn's
  new items, see :func:`join_arrays`); ``instructions`` are not among them;
* ``output_items``: the JSON array of the upstream's ``output`` items, serialized
  once when the response was stored;
* ``response``: the response object as ``GET /v1/responses/{id}`` returns it.

Invariants: every read and delete names the tenant, and a row of another tenant
is answered exactly as a missing one (``None`` / ``False``); an expired row
(``expires_at`` past) is never returned and is deleted by :meth:`ResponseStore.purge`
(run at most once a minute from :meth:`ResponseStore.put`); ids are unique across
tenants (a clashing id is not stored). Writes are immediate (no batching), so the
next turn finds the response on any worker process. The database file is the
stats database (``database.py``: created 0600). Blocking: call from a thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import (
    Column,
    Engine,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    delete,
    insert,
    select,
)
from sqlalchemy.exc import IntegrityError

from gateway.stats.table import metadata

DAY_S = 86_400.0
MAX_ID_CHARS = 128
PURGE_EVERY_S = 60.0

stored_response = Table(
    "stored_response",
    metadata,
    Column("id", String(MAX_ID_CHARS), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("turns", Integer, nullable=False),
    Column("input_items", LargeBinary, nullable=False),
    Column("output_items", LargeBinary, nullable=False),
    Column("response", LargeBinary, nullable=False),
    Index("ix_stored_response_expires_at", "expires_at"),
)


@dataclass(frozen=True)
class ResponseLimits:
    """Retention and size bounds (``--responses-ttl``, ``--responses-max-turns``,
    ``--responses-max-bytes``). ``ttl_s == 0`` turns the state API off: nothing is
    stored and ``previous_response_id`` is a 400."""

    ttl_s: float = 30 * DAY_S  # OpenAI keeps responses 30 days
    max_turns: int = 1000
    max_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise ValueError(f"responses ttl must be >= 0 seconds, got {self.ttl_s!r}")
        if self.max_turns < 1 or self.max_bytes < 1:
            raise ValueError(f"responses bounds must be >= 1, got {self.max_turns!r} turns, {self.max_bytes!r} bytes")

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant: str
    created_at: float
    turns: int  # 1 for a response without a previous one
    input_items: bytes
    output_items: bytes
    response: bytes


def join_arrays(*arrays: bytes) -> bytes:
    """The JSON arrays' elements in one array, joined as bytes (no element is re-encoded).

    Each argument is a compact JSON array (``[]`` or ``[...]``, as orjson writes)."""
    inner = [array[1:-1] for array in arrays if len(array) > 2]
    return b"[" + b",".join(inner) + b"]"


def parse_ttl(text: str) -> float:
    """Seconds from ``"3600"``, ``"90m"``, ``"12h"`` or ``"30d"``; ``ValueError`` naming the text."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1.0)
    try:
        value = float(number) * unit
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"--responses-ttl must be a duration like 3600, 90m, 12h or 30d, got {text!r}")
    return value


class ResponseStore:
    def __init__(self, engine: Engine, limits: ResponseLimits, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.limits = limits
        self.clock = clock
        self._last_purge = 0.0

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's unexpired response ``response_id``, else None. Changes nothing."""
        if len(response_id) > MAX_ID_CHARS:
            return None
        table = stored_response
        query = select(table).where(table.c.id == response_id, table.c.tenant == tenant,
                                    table.c.expires_at > self.clock())
        with self.engine.connect() as connection:
            row = connection.execute(query).first()
        if row is None:
            return None
        return StoredResponse(row.id, row.tenant, row.created_at, row.turns, row.input_items,
                              row.output_items, row.response)

    def put(self, response: StoredResponse) -> bool:
        """Store ``response`` for ``limits.ttl_s``; False (nothing stored) when its id is taken."""
        now = self.clock()
        row = {"id": response.id, "tenant": response.tenant, "created_at": response.created_at,
               "expires_at": now + self.limits.ttl_s, "turns": response.turns,
               "input_items": response.input_items, "output_items": response.output_items,
               "response": response.response}
        try:
            with self.engine.begin() as connection:
                connection.execute(insert(stored_response), row)
        except IntegrityError:
            return False
        if now - self._last_purge >= PURGE_EVERY_S:
            self.purge()
        return True

    def delete(self, tenant: str, response_id: str) -> bool:
        """Delete the tenant's response ``response_id``; False when there was none to delete."""
        table = stored_response
        with self.engine.begin() as connection:
            result = connection.execute(delete(table).where(
                table.c.id == response_id, table.c.tenant == tenant, table.c.expires_at > self.clock()))
        return bool(result.rowcount)

    def purge(self) -> int:
        """Delete every expired response; how many were deleted."""
        now = self.clock()
        self._last_purge = now
        with self.engine.begin() as connection:
            result = connection.execute(delete(stored_response).where(stored_response.c.expires_at <= now))
        return int(result.rowcount)
