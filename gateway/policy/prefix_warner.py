"""Prefix warnings: the linter's per-request rules plus a comparison with the
previous turn of the same conversation.

A *conversation* is identified, per tenant, as the linter defines it
(:func:`linter.api.conversation_keys`, one definition for both): the
``x-prefixgate-conversation`` header, ``metadata.conversation_id`` or
``prompt_cache_key``, else an earlier request whose messages this one extends.
Never the first user message alone. Requests without a user message and without
an id are checked on their own only.

Memory is bounded: at most ``max_tenants`` tenants x ``max_conversations``
conversations are remembered (least recently used evicted first), and bodies
larger than ``max_body_bytes`` are not remembered.

The linter is advisory: if a rule raises on odd input, the request goes on
without that rule's warnings (logged), it is never failed because of it.

Execution and bounds (:meth:`PrefixWarner.check_within_budget`, what the proxy
calls just before the upstream call): the history exchange starts at once and is
awaited on the event loop, never blocking it; the linter waits until the request
is on the wire (``lint_after``), and where it runs depends on the body's size.
Up to ``loop_max_bytes`` (8 KiB) it runs on the event loop itself: its worst case
there (dense dates, ~0.8 ms per KiB) is about one GIL switch interval (5 ms),
which is how long a check on a thread would hold the GIL, and so the loop, anyway;
and the two thread hand-offs it saves cost more than a typical check (~20 us).
Only text does: a body with a ``data:`` URL, or whose conversation's previous turn
has one or is larger than ``loop_max_bytes`` (:func:`light`, a walk bounded by that
size), leaves the loop, and on the loop no image is decoded at all (a pixel budget
of 0). A check that names images (a ``data:`` URL in either turn) runs in the helper
process whatever its size: decoding and hashing nine 2048x2048 images took half a
second, and in a thread the GIL would still stall the loop for milliseconds at a
time. There images are decoded within the tenant's
:class:`~gateway.policy.pixel_rate.PixelRate` (pixels per request and per second; past it
an image is named by a hash of its bytes, :mod:`linter.image_parts`), each once.
Up to ``inline_max_bytes`` it runs on a small thread pool (the loop gets the GIL
back every switch interval). Larger bodies are checked in a helper process
instead (the linter's work grows faster than the body; in a thread it would hold
the GIL, and so every other request, for seconds), which is killed when the
budget runs out. A request waits at most ``budget_s`` for its warnings once it is
on the wire (history exchange included); past it, it gets one ``GW001`` warning
saying the check was cut short. At most ``max_warnings`` warnings of at most
``max_warning_bytes`` in all are returned; the rest are summarised in one warning
per code ("N more ...").

With several worker processes, ``history`` is the supervisor's shared
:class:`~gateway.policy.shared_history.HistoryClient`, so turns of one conversation are
compared whichever worker they reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from gateway.policy.lint_check import (
    PrefixWarning,
    bound_warnings,
    light,
    lint,
    request_warnings,
    turn_warnings,
)
from gateway.policy.lint_process import LintProcess
from gateway.policy.pixel_rate import PixelRate
from linter.api import (
    CONVERSATION_HEADER,
    ConversationKeys,
    Turn,
    conversation_keys,
    remember_turn,
    take_previous,
)
from linter.image_parts import PixelBudget, pixel_budget

log = logging.getLogger(__name__)

__all__ = ["BUDGET_CODE", "CONVERSATION_HEADER", "History", "PrefixWarner", "PrefixWarning"]

BUDGET_CODE = "GW001"

_T = TypeVar("_T")


class History(Protocol):
    """Where a conversation's latest turn is kept: this process's :class:`PrefixWarner`,
    or the supervisor's (:class:`~gateway.policy.shared_history.HistoryClient`)."""

    def start(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> Awaitable[Mapping[str, Any] | None]:
        """Remember ``body`` as the conversation's latest turn, starting now; the awaitable
        gives the previous one, or None."""
        ...

    def close(self) -> None: ...


class PrefixWarner:
    def __init__(
        self,
        *,
        max_tenants: int = 1024,
        max_conversations: int = 64,
        max_body_bytes: int = 512 * 1024,
        max_warnings: int = 32,
        max_warning_bytes: int = 16 * 1024,
        budget_s: float = 1.0,
        inline_max_bytes: int = 64 * 1024,
        loop_max_bytes: int = 8 * 1024,
        history: History | None = None,
        pixels: PixelRate | None = None,
    ) -> None:
        self.max_tenants = max_tenants
        self.max_conversations = max_conversations
        self.max_body_bytes = max_body_bytes
        self.max_warnings = max_warnings
        self.max_warning_bytes = max_warning_bytes
        self.budget_s = budget_s
        self.inline_max_bytes = inline_max_bytes
        self.loop_max_bytes = loop_max_bytes
        self.history: History = history or self
        self.pixels = pixels or PixelRate(max_tenants=max_tenants)
        self._history: OrderedDict[str, OrderedDict[str, Turn]] = OrderedDict()  # tenant -> key -> turn
        self._seq = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._lint_process: LintProcess | None = None

    async def check_within_budget(
        self,
        tenant: str,
        original: Mapping[str, Any],
        canonical: Mapping[str, Any],
        *,
        body_size: int,
        conversation_header: str | None = None,
        raw: bytes | None = None,
        lint_after: Awaitable[Any] | None = None,
    ) -> list[PrefixWarning]:
        """:meth:`check`'s findings, with the history exchange awaited on the event loop
        (it never blocks it) and the linter run where ``body_size`` says (see the module
        docstring); at most ``budget_s`` of waiting.

        The history exchange starts at once; the linter waits for ``lint_after`` (the
        proxy passes "the request is on its way upstream": the exchange's round trip
        overlaps the upstream call, and the linter's CPU does not delay the send), and
        the budget counts from then."""
        # A check still queued when its request stops waiting (budget spent, client gone)
        # is dropped: under overload, stale checks must not eat the CPU that the next
        # requests need. One already running on a thread finishes there.
        try:
            async with asyncio.timeout(None if lint_after is not None else self.budget_s) as budget:
                return await self._check(tenant, original, canonical, body_size, conversation_header, raw,
                                         lint_after, budget)
        except TimeoutError:
            return [self._over_budget()]

    async def _check(
        self, tenant: str, original: Mapping[str, Any], canonical: Mapping[str, Any], body_size: int,
        conversation_header: str | None, raw: bytes | None, lint_after: Awaitable[Any] | None,
        budget: asyncio.Timeout,
    ) -> list[PrefixWarning]:
        limit = min(self.loop_max_bytes, self.inline_max_bytes)  # never wait for the helper on the loop
        on_loop = body_size <= limit and light(original, limit) and light(canonical, limit)
        keys = (conversation_keys(canonical, conversation_header) if on_loop
                else await self._on_thread(conversation_keys, canonical, conversation_header))
        exchange = self.history.start(tenant, keys, canonical, body_size) if keys is not None else None
        if lint_after is not None:
            await lint_after
            budget.reschedule(asyncio.get_running_loop().time() + self.budget_s)  # counted from the send
        # on the loop, the per-request rules run while the history's reply is on its way
        own = None
        if on_loop:
            with pixel_budget(PixelBudget(0)):
                own = request_warnings(original)
        previous = await exchange if exchange is not None else None
        if on_loop and (previous is None or light(previous, limit)):
            return self._findings(original, previous, canonical, keys, body_size, raw, own, PixelBudget(0))
        pixels = PixelBudget(self.pixels.allowance(tenant))
        try:
            return await self._on_thread(self._findings, original, previous, canonical, keys, body_size, raw,
                                         own, pixels)
        finally:
            self.pixels.charge(tenant, pixels.used)  # so far: a check cut short may decode on, within its limit

    async def _on_thread(self, function: Callable[..., _T], *args: Any) -> _T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefixgate-lint")
        future = asyncio.get_running_loop().run_in_executor(self._pool, function, *args)
        try:
            return await future
        finally:
            future.cancel()  # queued and no longer awaited: never started

    def close(self) -> None:
        """Stop the threads, the helper process (after the running checks) and the history's connection."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._lint_process is not None:
            self._lint_process.stop()
        if self.history is not self:
            self.history.close()

    def _over_budget(self) -> PrefixWarning:
        return PrefixWarning(
            BUDGET_CODE, "info",
            f"the prefix check of this request did not finish within {self.budget_s:g} s; "
            "its warnings are incomplete", "",
        )

    def check(
        self,
        tenant: str,
        original: Mapping[str, Any],
        canonical: Mapping[str, Any],
        *,
        body_size: int,
        conversation_header: str | None = None,
        raw: bytes | None = None,
    ) -> list[PrefixWarning]:
        """Findings for one request, all in the calling thread, with this process's own
        history (:meth:`remember`); remembers ``canonical`` as the conversation's latest turn.

        ``raw``, the client's bytes of ``original`` (``cache_salt`` aside), saves
        re-encoding a large body for the helper process.

        Per-request rules see the body as the client sent it (so input the gateway
        had to canonicalize is reported); the cross-turn comparison sees canonical
        bodies (what the upstream cache sees).
        """
        keys = conversation_keys(canonical, conversation_header)
        previous = self.remember(tenant, keys, canonical, body_size) if keys is not None else None
        return self._findings(original, previous, canonical, keys, body_size, raw)

    def _findings(
        self, original: Mapping[str, Any], previous: Mapping[str, Any] | None, canonical: Mapping[str, Any],
        keys: ConversationKeys | None, body_size: int, raw: bytes | None,
        own: list[PrefixWarning] | None = None, pixels: PixelBudget | None = None,
    ) -> list[PrefixWarning]:
        """The linter's bounded findings, given the conversation's ``previous`` turn
        (and ``own``, the per-request rules' findings, when already computed), decoding
        at most ``pixels`` of images (None: no bound, the synchronous :meth:`check`).

        With ``pixels``, a check that names images runs in the helper process, as large
        bodies do: decoding and hashing pixels in a thread would hold the GIL, and so
        the event loop, for milliseconds at a time."""
        # An exact repeat (a retry) extends its predecessor trivially: nothing to compare.
        if previous is not None and previous == canonical:
            previous = None
        # A prompt_cache_key may name many conversations: only truncations and static changes count.
        edits = keys is None or not keys.shared
        images = pixels is not None and any(
            not light(body, sys.maxsize) for body in (original, canonical, previous) if body is not None)
        if body_size > self.inline_max_bytes or images:
            if self._lint_process is None:
                self._lint_process = LintProcess(self.max_warnings, self.max_warning_bytes)
            found = self._lint_process.check(original, previous, canonical, self.budget_s, raw, edits, pixels)
            if found is None:
                return [self._over_budget()]
            return bound_warnings([PrefixWarning(**item) for item in found], self.max_warnings,
                                  self.max_warning_bytes)
        with pixel_budget(pixels) if pixels is not None else contextlib.nullcontext():
            warnings = lint(original, previous, canonical, edits) if own is None else own + turn_warnings(
                previous, canonical, edits)
        return bound_warnings(warnings, self.max_warnings, self.max_warning_bytes)

    def start(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> Awaitable[Mapping[str, Any] | None]:
        """:meth:`remember`, as the :class:`History` protocol has it (one process: done at once)."""
        done: asyncio.Future[Mapping[str, Any] | None] = asyncio.get_running_loop().create_future()
        done.set_result(self.remember(tenant, keys, body, body_size))
        return done

    def remember(
        self, tenant: str, keys: ConversationKeys, body: Mapping[str, Any], body_size: int
    ) -> Mapping[str, Any] | None:
        """Store ``body`` as the conversation's latest turn (bounded LRU); the previous one
        (the first of ``keys.lookup`` found, taken out of the history)."""
        conversations = self._history.get(tenant)
        if conversations is None:
            conversations = self._history[tenant] = OrderedDict()
            if len(self._history) > self.max_tenants:
                self._history.popitem(last=False)
        else:
            self._history.move_to_end(tenant)
        turn = take_previous(conversations, keys)  # the most recent found, taken out under all its keys
        if body_size <= self.max_body_bytes:
            remember_turn(conversations, keys, body, next(self._seq))  # also by its latest model output
            while len(conversations) > self.max_conversations:
                conversations.popitem(last=False)
        return None if turn is None else turn.value
