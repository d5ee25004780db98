"""ReplicaSet: the engine replicas behind the gateway, their health, and one request's route.

* Health: a background task GETs every replica's ``/health`` each
  ``health_interval_s`` (timeout: ``HEALTH_TIMEOUT_S`` or the interval, the
  larger). A replica leaves the pool (the router skips it while any replica is
  healthy, and its index is dropped) when no connection can be made to it, at
  once, or after ``FAILURES_TO_LEAVE`` checks in a row that failed otherwise (a
  busy engine answering slowly keeps its place and its blocks); it rejoins as soon
  as a check succeeds. A connection refused during a request takes it out at once,
  and so does a request that waits on it without a byte for the idle timeout while
  its ``/health`` does not answer either (``stall_watchdog.py``: a frozen replica's
  requests end with a 504 within about 21 s instead of the total timeout).
* Retry: a request whose connection to a replica fails before any byte of it was
  sent (connect refused or timed out: :class:`UpstreamUnreachable`) is sent to
  the next best replica; each replica is tried at most once. Nothing is retried once the request was written: the engine may
  have started on it.
* PML prompts route by their schema's affinity, not block keys
  (:mod:`gateway.routing.schema_affinity`); the schema routes tell
  :attr:`ReplicaSet.affinity` each schema's size.
* Accounting: :meth:`ReplicaSet.route` counts the request in flight on its replica
  (with the tokens it was predicted to prefill) and marks its keys pending there; :meth:`ReplicaSet.finish` (called once, when
  the stats row is recorded) undoes both and counts predicted vs reported cached
  tokens per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx

from gateway.config.replica_spec import ReplicaSpec, RoutingOptions
from gateway.errors import GatewayError, UpstreamUnavailable, UpstreamUnreachable
from gateway.request_record import RequestRecord
from gateway.routing.block_index import ReplicaIndex
from gateway.routing.block_keys import BlockKeyer, RequestKeys
from gateway.routing.kv_events import EventSource, KvEventSubscriber
from gateway.routing.router import Router
from gateway.routing.schema_affinity import Affinity, SchemaAffinity
from gateway.upstream.client import Upstream
from gateway.upstream.stall_watchdog import StallWatchdog

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
FAILURES_TO_LEAVE = 3


class Replica:
    """One engine replica: its upstream, index, health and counters."""

    def __init__(self, spec: ReplicaSpec, client: httpx.AsyncClient, kind: str = "vllm",
                 api_key: str | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.upstream = Upstream(spec.url, client, kind=kind, api_key=api_key)
        self.index = ReplicaIndex(has_events=spec.kv_events is not None)
        self.healthy = True
        self.failed_checks = 0
        self.in_flight = 0
        self.queued_prefill = 0
        self.last_chosen = 0
        self.requests = 0
        self.retried_away = 0
        self.stalls = 0
        self.predicted_tokens = 0
        self.reported_tokens = 0
        self.predictions_exact = 0
        self.predictions_compared = 0
        self.subscriber: KvEventSubscriber | None = None
        if spec.kv_events is not None:
            source = EventSource(spec.kv_events, spec.kv_events_replay, spec.kv_events_topic)
            self.subscriber = KvEventSubscriber(source, self.index, spec.name)

    def set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            log.warning("replica %s (%s) %s", self.name, self.spec.url,
                        "is healthy again: rejoins the pool" if healthy else "is unhealthy: leaves the pool")
        if not healthy:
            self.index.forget()
        self.healthy = healthy

    async def probe(self, timeout: float) -> bool:
        """Whether ``/health`` answers 2xx within ``timeout`` (changes nothing)."""
        try:
            await self.upstream.check_health(timeout=timeout)
        except GatewayError:
            return False
        return True


class _SentMark:
    """The ``on_sent`` hook handed to the upstream: remembers that the request went out
    (so it is never retried) and forwards to the caller's own hook."""

    def __init__(self, on_sent: Callable[[], None] | None) -> None:
        self.sent = False
        self.on_sent = on_sent

    def __call__(self) -> None:
        self.sent = True
        if self.on_sent is not None:
            self.on_sent()


class Route:
    """Where one request goes; :meth:`post` / :meth:`stream` retry before anything was sent."""

    def __init__(self, replicas: ReplicaSet, record: RequestRecord, keys: RequestKeys | None,
                 affinity: Affinity | None = None) -> None:
        self.replicas = replicas
        self.record = record
        self.keys = keys
        self.affinity = affinity
        self.replica: Replica | None = None
        self.prefill_tokens = 0
        self.tried: list[Replica] = []
        self.finished = False
        self.deadline = replicas.watchdog.deadline()

    def _pick(self) -> Replica:
        choice = self.replicas.router.choose(self.replicas.replicas, self.keys, exclude=self.tried,
                                             affinity=self.affinity)
        if choice is None:
            raise UpstreamUnavailable("no replica could be reached")
        replica = choice.replica
        assert isinstance(replica, Replica)
        self._release()
        self.replica = replica
        self.tried.append(replica)
        replica.in_flight += 1
        self.prefill_tokens = choice.prefill_tokens
        replica.queued_prefill += self.prefill_tokens
        replica.requests += 1
        if self.keys is not None:
            replica.index.routed(self.keys.keys)
        self.record.upstream = replica.spec.url
        self.record.replica = replica.name
        self.record.predicted_cached_tokens = choice.predicted_cached_tokens
        return replica

    def _release(self) -> None:
        replica = self.replica
        if replica is None:
            return
        replica.in_flight -= 1
        replica.queued_prefill -= self.prefill_tokens
        if self.keys is not None:
            replica.index.finished(self.keys.keys)
        self.replica = None

    def _retry_after(self, error: GatewayError, sent: bool) -> bool:
        """True when ``error`` happened before the request reached the replica and another is left."""
        if sent or not isinstance(error, UpstreamUnreachable) or self.replica is None:
            return False
        self.replica.set_healthy(False)
        self.replica.retried_away += 1
        return len(self.tried) < len(self.replicas.replicas)

    async def post(self, path: str, content: bytes, on_sent: Callable[[], None] | None = None
                   ) -> tuple[dict[str, Any], bytes]:
        mark = _SentMark(on_sent)
        replica = self.replica or self._pick()
        watchdog = self.replicas.watchdog
        while True:
            try:
                answer = replica.upstream.post(path, content, mark, self.record.tenant)
                return await watchdog.wait(replica, answer, self.deadline)
            except GatewayError as error:
                if not self._retry_after(error, mark.sent):
                    raise
                replica = self._pick()

    @asynccontextmanager
    async def stream(self, path: str, content: bytes, on_sent: Callable[[], None] | None = None
                     ) -> AsyncIterator[AsyncIterator[bytes]]:
        mark = _SentMark(on_sent)
        replica = self.replica or self._pick()
        watchdog = self.replicas.watchdog
        while True:
            stack = contextlib.AsyncExitStack()
            try:
                opened = stack.enter_async_context(replica.upstream.stream(path, content, mark, self.record.tenant))
                chunks = await watchdog.wait(replica, opened, self.deadline)
            except GatewayError as error:
                await stack.aclose()
                if not self._retry_after(error, mark.sent):
                    raise
                replica = self._pick()
                continue
            async with stack:
                yield watchdog.chunks(replica, chunks, self.deadline)
            return

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        replica = self.replica
        self._release()
        record = self.record
        if replica is None or record.predicted_cached_tokens is None or record.cached_tokens is None:
            return
        replica.predicted_tokens += record.predicted_cached_tokens
        replica.reported_tokens += record.cached_tokens
        replica.predictions_compared += 1
        replica.predictions_exact += record.predicted_cached_tokens == record.cached_tokens


def load_keyer(options: RoutingOptions) -> BlockKeyer | None:
    """Block keys from ``options.tokenizer``, else the bundled model's tokenizer when it exists.

    Without one the replicas are balanced by load only (logged once)."""
    from engine.contract.model_location import converted_model_dir

    model_dir = options.tokenizer
    if model_dir is None and (converted_model_dir() / "tokenizer.json").is_file():
        model_dir = converted_model_dir()
    if model_dir is None:
        log.warning("no --tokenizer and no converted bundled model: routing by load only, without block keys")
        return None
    return BlockKeyer.from_model_dir(model_dir, options.block_size)


class ReplicaSet:
    def __init__(self, specs: Sequence[ReplicaSpec], client: httpx.AsyncClient,
                 options: RoutingOptions | None = None, keyer: BlockKeyer | None = None,
                 kind: str = "vllm", api_key: str | None = None,
                 watchdog: StallWatchdog | None = None) -> None:
        """``kind`` and ``api_key``: as :class:`Upstream` takes them, the same for every replica;
        ``watchdog``: ends requests stuck on a replica (default: 15 s idle, 600 s total)."""
        if not specs:
            raise ValueError("at least one replica is needed")
        self.options = options or RoutingOptions()
        self.kind = kind
        self.replicas = [Replica(spec, client, kind, api_key) for spec in specs]
        self.router = Router(self.options.load_cost_tokens, self.options.miss_weight)
        self.keyer = keyer if keyer is not None or len(specs) < 2 else load_keyer(self.options)
        self.watchdog = watchdog or StallWatchdog()
        self.affinity = SchemaAffinity()
        self._health_task: asyncio.Task[None] | None = None

    @property
    def primary(self) -> Upstream:
        """The first healthy replica's upstream (for ``/v1/models``)."""
        return next((r.upstream for r in self.replicas if r.healthy), self.replicas[0].upstream)

    async def get(self, path: str) -> dict[str, Any]:
        """GET a JSON object from the first replica that can be reached (healthy ones first)."""
        ordered = sorted(self.replicas, key=lambda r: not r.healthy)
        for replica in ordered:
            try:
                return await replica.upstream.get(path)
            except UpstreamUnreachable:
                replica.set_healthy(False)
                if replica is ordered[-1]:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def route(self, record: RequestRecord, body: dict[str, Any]) -> Route:
        """The route of one request whose upstream body (salt included) is ``body``."""
        keys, affinity = None, None
        if len(self.replicas) > 1 and body.get("prompt_format") == "pml":  # parsed off the event loop
            affinity = await anyio.to_thread.run_sync(self.affinity.of, record.endpoint, body)
        if self.keyer is not None and len(self.replicas) > 1 and affinity is None:
            keys = await anyio.to_thread.run_sync(self.keyer.keys, record.endpoint, body, body.get("cache_salt"))
        route = Route(self, record, keys, affinity)
        record.route = route
        return route

    @staticmethod
    def finish(record: RequestRecord) -> None:
        route = record.route
        if isinstance(route, Route):
            route.finish()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for replica in self.replicas:
            if replica.subscriber is not None:
                replica.subscriber.start()
        self.watchdog.start()
        if self._health_task is None and len(self.replicas) > 1:
            self._health_task = asyncio.get_running_loop().create_task(self._check_health_forever())

    async def aclose(self) -> None:
        await self.watchdog.aclose()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for replica in self.replicas:
            if replica.subscriber is not None:
                await anyio.to_thread.run_sync(replica.subscriber.stop)

    async def check_health(self) -> None:
        """One round of health checks (all replicas concurrently)."""
        timeout = max(HEALTH_TIMEOUT_S, self.options.health_interval_s)

        async def check(replica: Replica) -> None:
            try:
                await replica.upstream.check_health(timeout=timeout)
            except UpstreamUnreachable:
                replica.failed_checks = FAILURES_TO_LEAVE
                replica.set_healthy(False)
            except GatewayError:
                replica.failed_checks += 1
                if replica.failed_checks >= FAILURES_TO_LEAVE:
                    replica.set_healthy(False)
            else:
                replica.failed_checks = 0
                replica.set_healthy(True)

        await asyncio.gather(*(check(r) for r in self.replicas))

    async def _check_health_forever(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.options.health_interval_s)

    async def any_healthy(self) -> GatewayError | None:
        """None when some replica answers ``/health``; the last error otherwise."""
        error: GatewayError | None = None
        for replica in self.replicas:
            try:
                await replica.upstream.check_health()
                return None
            except GatewayError as exc:
                error = exc
        return error
