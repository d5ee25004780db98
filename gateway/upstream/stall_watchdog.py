"""StallWatchdog: requests waiting on an upstream that sends nothing, and the replica behind them.

Every wait of a request on its replica (the whole answer of a non-streamed call,
the response head of a stream, then each chunk of it) is a :class:`Watch`: the
task that waits, when it last received something and its request's deadline. A
background task scans them every ``tick_s``:

* a watch past ``total_s`` since its request started ends with
  :class:`UpstreamTimeout` (the total timeout, ``upstream_timeout_s``);
* a replica with a watch idle for ``idle_s`` (no byte: ``upstream_idle_timeout_s``)
  gets one ``/health`` probe (``probe_timeout_s``). If it answers, the replica is
  alive and busy (queued behind long prompts, a long non-streamed answer): its idle
  watches wait another ``idle_s``. If it does not, the replica is stuck (frozen,
  SIGSTOPped, wedged): it leaves the pool at once (the health checks bring it back
  when it answers again) and every request waiting on it ends now with
  :class:`UpstreamStalled`, an OpenAI-shaped 504 (an error event in a stream).

So a stuck replica costs its requests at most ``idle_s + tick_s + probe_timeout_s``
(about 21 s by default), and new requests go elsewhere. Ending a wait cancels the
waiting task; :meth:`StallWatchdog.wait` and :meth:`StallWatchdog.chunks` turn
that cancellation back into the gateway error, so callers see an ordinary
:class:`GatewayError` (and closing the upstream response drops its connection).
Invariant: a watch is registered only while its request waits, and removed in a
``finally``; the watchdog never cancels a task that is not waiting on its replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from gateway.errors import GatewayError, UpstreamStalled, UpstreamTimeout

log = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 5.0


class Watched(Protocol):
    """What the watchdog needs of a replica (``gateway.routing.replicas.Replica``)."""

    name: str
    stalls: int

    async def probe(self, timeout: float) -> bool: ...

    def set_healthy(self, healthy: bool) -> None: ...


class Watch:
    __slots__ = ("deadline", "error", "replica", "since", "task", "waiting")

    def __init__(self, replica: Watched, deadline: float) -> None:
        self.replica = replica
        self.task: asyncio.Task[Any] | None = None
        self.since = time.monotonic()
        self.deadline = deadline
        self.waiting = False
        self.error: GatewayError | None = None

    def wait_now(self) -> None:
        self.task = asyncio.current_task()
        self.since = time.monotonic()
        self.waiting = True

    def end(self, error: GatewayError) -> None:
        """Cancel the waiting task; its wait raises ``error`` instead."""
        if self.waiting and self.error is None and self.task is not None:
            self.error = error
            self.task.cancel()

    def raise_error(self) -> None:
        """Inside ``except CancelledError``: re-raise as the gateway error if the watchdog cancelled."""
        if self.error is None:
            return
        if self.task is not None:
            self.task.uncancel()
        raise self.error


class StallWatchdog:
    def __init__(self, idle_s: float = IDLE_TIMEOUT_S, total_s: float = 600.0,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, tick_s: float | None = None) -> None:
        if idle_s <= 0 or total_s <= 0:
            raise ValueError(f"timeouts must be > 0, got idle {idle_s!r}, total {total_s!r}")
        self.idle_s = idle_s
        self.total_s = total_s
        self.probe_timeout_s = probe_timeout_s
        self.tick_s = tick_s if tick_s is not None else min(1.0, idle_s / 4)
        self._watches: set[Watch] = set()
        self._task: asyncio.Task[None] | None = None

    def deadline(self) -> float:
        """The deadline of a request starting now (pass it to every wait of that request)."""
        return time.monotonic() + self.total_s

    async def wait(self, replica: Watched, awaitable: Awaitable[T], deadline: float) -> T:
        """Await ``awaitable`` (which receives from ``replica``) under the watchdog."""
        watch = Watch(replica, deadline)
        watch.wait_now()
        self._watches.add(watch)
        try:
            return await awaitable
        except asyncio.CancelledError:
            watch.raise_error()
            raise
        finally:
            watch.waiting = False
            self._watches.discard(watch)

    async def chunks(self, replica: Watched, chunks: AsyncIterator[bytes], deadline: float
                     ) -> AsyncIterator[bytes]:
        """``chunks`` with each read under the watchdog (not the time the caller spends between reads)."""
        watch = Watch(replica, deadline)
        self._watches.add(watch)
        try:
            while True:
                watch.wait_now()
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    watch.raise_error()
                    raise
                finally:
                    watch.waiting = False
                yield chunk
        finally:
            self._watches.discard(watch)

    # ------------------------------------------------------------ the scan
    async def scan(self) -> None:
        """One pass: end the requests past their deadline, probe replicas with idle requests."""
        now = time.monotonic()
        idle: dict[Watched, list[Watch]] = {}
        for watch in list(self._watches):
            if not watch.waiting:
                continue
            if now >= watch.deadline:
                watch.end(UpstreamTimeout(f"upstream timed out: no complete answer within {self.total_s:g} s"))
            elif now - watch.since >= self.idle_s:
                idle.setdefault(watch.replica, []).append(watch)
        if not idle:
            return
        replicas = list(idle)
        alive = await asyncio.gather(*(r.probe(self.probe_timeout_s) for r in replicas))
        for replica, answered in zip(replicas, alive, strict=True):
            if answered:  # busy, not stuck: wait another idle period before asking again
                now = time.monotonic()
                for watch in idle[replica]:
                    watch.since = now
                continue
            replica.stalls += 1
            replica.set_healthy(False)
            message = (f"replica {replica.name} sent nothing for {self.idle_s:g} s and did not answer "
                       f"its health check within {self.probe_timeout_s:g} s: the request was ended")
            ended = [w for w in self._watches if w.replica is replica and w.waiting]
            log.error("%s (%d request(s))", message, len(ended))
            for watch in ended:
                watch.end(UpstreamStalled(message))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.scan()
            except Exception:  # never let one bad pass stop the watchdog
                log.exception("stall watchdog pass failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
