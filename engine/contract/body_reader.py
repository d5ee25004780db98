"""BodyReader: the one bounded reader of JSON request bodies, for the engine and the gateway.

Pure Python (Starlette and asyncio only), so the gateway imports it too. A body is
refused, in OpenAI's error shape (:class:`~engine.contract.errors.APIError`), when

- its ``Content-Type`` is not ``application/json`` (parameters such as ``charset``
  allowed): 415 ``unsupported_media_type``. Other types would let a web page make a
  browser POST to a local server without a CORS preflight;
- it declares or sends more than ``max_bytes``: 413 ``request_too_large``;
- it would take the bytes of bodies in flight past the budget: its tenant's share
  (``tenant_inflight_bytes``, 429 ``body_budget_exceeded``) or the whole server's
  (``inflight_bytes``, 503 ``server_overloaded``);
- no byte arrives for ``idle_timeout_s`` or the whole body takes more than
  ``timeout_s``: 408 ``body_timeout``;
- the client disconnects while sending it: 400 ``client_disconnected``.

Budget invariant: a :class:`BodyLease` holds the bytes its body declared (or, without
a ``Content-Length``, those received so far) from the first chunk until
:meth:`BodyLease.release`, which the caller runs when it no longer holds the body or
anything built from it; the reader's totals are the sums of the live leases
(``check_integrity``). The memory a body costs is a small multiple of its size
(the bytes, their parse, a re-encoding), so the budget bounds it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from types import TracebackType

from starlette.requests import Request

from engine.contract import errors
from engine.contract.pixel_budget import trim_heap

MIB = 1024 * 1024
JSON_MEDIA_TYPE = "application/json"
# Names the tenant a request is for (the gateway sets it): the engine's body budget and
# the scheduler's prefill sharing are keyed by it (without it: one body key for every
# client, inside the overall budget; prefill by cache salt). Not isolation: the salt's job.
TENANT_HEADER = "x-prefixgate-tenant"


TRIM_AFTER_BYTES = 16 * MIB
TRIM_DELAY_S = 1.0


@dataclass(frozen=True)
class BodyLimits:
    """How large, how many and how slow request bodies may be (see the module docstring)."""

    max_bytes: int = 32 * MIB
    inflight_bytes: int = 256 * MIB
    tenant_inflight_bytes: int = 128 * MIB
    timeout_s: float = 120.0
    idle_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "inflight_bytes", "tenant_inflight_bytes", "timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")


def require_json(content_type: str | None) -> None:
    """Return if ``content_type`` is ``application/json`` with or without parameters; 415 otherwise."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = repr(content_type) if content_type else "none"
        raise errors.APIError(
            415, f"Content-Type must be application/json, got {shown}.", code="unsupported_media_type"
        )


class BodyLease:
    """The budget one request's body holds; :meth:`release` (idempotent) gives it back.

    ``tenant`` may be set (once known) until the lease first takes bytes, not after."""

    def __init__(self, reader: BodyReader, tenant: str) -> None:
        self.reader = reader
        self.tenant = tenant
        self.held = 0

    def take(self, size: int) -> None:
        """Hold ``size`` bytes in all (never less than already held); 429/503 past the budget."""
        if size > self.held:
            self.reader._grow(self, size - self.held)

    def release(self) -> None:
        if self.held:
            self.reader._shrink(self)

    def __enter__(self) -> BodyLease:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class BodyReader:
    """One per server: its :class:`BodyLimits` and the bytes of bodies in flight, overall and per tenant.

    Runs on the event loop only (no lock).

    Memory: the bytes of large bodies (and what parsing them built) leave the C heap
    fragmented, in several malloc arenas when they were parsed on threads, and the
    process keeps that RSS after a burst. Once the bodies in flight drop to zero after
    at least :data:`TRIM_AFTER_BYTES` were released, the heap is trimmed
    (``malloc_trim``) :data:`TRIM_DELAY_S` later, on a worker thread, if still none is
    in flight: the delay lets the finished requests' objects go first."""

    def __init__(self, limits: BodyLimits | None = None) -> None:
        self.limits = limits or BodyLimits()
        self.in_flight = 0
        self.by_tenant: Counter[str] = Counter()
        self._leases: set[BodyLease] = set()
        self._released = 0  # bytes released since the last trim
        self._trim: asyncio.TimerHandle | None = None

    def lease(self, tenant: str = "") -> BodyLease:
        """An empty lease for one body of ``tenant`` (the budget's key; "" when unknown)."""
        return BodyLease(self, tenant)

    async def read(self, request: Request, lease: BodyLease) -> bytes:
        """The whole body of ``request``, charged to ``lease``; an APIError for each refusal above."""
        require_json(request.headers.get("content-type"))
        limits = self.limits
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limits.max_bytes:
                raise errors.body_too_large(limits.max_bytes)
            lease.take(int(declared))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.timeout_s
        receive = request.receive
        chunks: list[bytes] = []
        size = 0
        try:
            # One timer for the whole body, moved on at each chunk: a context per chunk
            # would cost more than the rest of the read.
            async with asyncio.timeout(min(deadline, loop.time() + limits.idle_timeout_s)) as timer:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # http.disconnect
                        raise errors.APIError(400, "The client disconnected while sending the body.",
                                              code="client_disconnected")
                    chunk = message.get("body", b"")
                    if chunk:
                        size += len(chunk)
                        if size > limits.max_bytes:
                            raise errors.body_too_large(limits.max_bytes)
                        lease.take(size)
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
                    timer.reschedule(min(deadline, loop.time() + limits.idle_timeout_s))
        except TimeoutError:
            why = (f"over {limits.timeout_s:g} s" if loop.time() >= deadline
                   else f"no byte for {limits.idle_timeout_s:g} s")
            raise errors.APIError(408, f"The request body was not received in time: {why}.",
                                  code="body_timeout") from None
        return b"".join(chunks)

    def check_integrity(self) -> None:
        """The totals are the sums of the live leases, within the limits; nothing negative."""
        assert self.in_flight == sum(lease.held for lease in self._leases), self.in_flight
        held: Counter[str] = Counter()
        for lease in self._leases:
            assert lease.held > 0, lease.held
            held[lease.tenant] += lease.held
        assert held == +self.by_tenant, (held, self.by_tenant)
        assert self.in_flight <= self.limits.inflight_bytes, self.in_flight
        assert all(v <= self.limits.tenant_inflight_bytes for v in held.values()), held

    def _grow(self, lease: BodyLease, more: int) -> None:
        limits = self.limits
        if self.by_tenant[lease.tenant] + more > limits.tenant_inflight_bytes:
            raise errors.APIError(
                429, f"Too many request body bytes in flight for this client (limit "
                f"{limits.tenant_inflight_bytes} bytes); retry when earlier requests have finished.",
                type="rate_limit_error", code="body_budget_exceeded")
        if self.in_flight + more > limits.inflight_bytes:
            raise errors.APIError(
                503, f"The server holds too many request body bytes (limit {limits.inflight_bytes} bytes); "
                "retry shortly.", type=errors.SERVER_ERROR, code="server_overloaded")
        lease.held += more
        self.in_flight += more
        self.by_tenant[lease.tenant] += more
        self._leases.add(lease)

    def _shrink(self, lease: BodyLease) -> None:
        self.in_flight -= lease.held
        self.by_tenant[lease.tenant] -= lease.held
        if not self.by_tenant[lease.tenant]:
            del self.by_tenant[lease.tenant]
        self._released += lease.held
        lease.held = 0
        self._leases.discard(lease)
        if not self.in_flight and self._released >= TRIM_AFTER_BYTES and self._trim is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # released outside a loop (a test): nothing to schedule
                return
            self._trim = loop.call_later(TRIM_DELAY_S, self._trim_if_idle, loop)

    def _trim_if_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        self._trim = None
        if not self.in_flight:
            self._released = 0
            loop.run_in_executor(None, trim_heap)
