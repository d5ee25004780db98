"""A helper process that runs the linter on large request bodies, within a budget.

The linter's per-request rules do work that grows faster than the body (a 7.5 MiB
system prompt full of dates took 9-25 s and produced 429k findings; 64 KiB of
dense dates 170 ms). A thread cannot be stopped, and a thread running pure Python
holds the GIL for its 5 ms slices, delaying every other request of the process.
So the gateway sends large bodies here and waits at most the check's budget.

The child times itself: it arms a SIGALRM timer for the budget it is sent with
each body, and when it fires the check raises, the child answers ``null`` and
waits for the next body (no new interpreter to start). The parent counts the
answers it stopped waiting for and reads them before its next request; a child
that owes answers past the next caller's budget (stuck in one long C call) is
killed and replaced. A child still importing when a body arrives is not sent it
(it says ``ready`` first): the caller gets no warnings rather than waiting.

One check at a time (a lock); a caller that cannot get the process within its
budget gives up. The child runs at a lower CPU priority (nice 10): its work is
advisory, and on busy CPUs the serving process must not wait for it. The child bounds its findings (``bound_warnings``) before
sending them back, so the reply is small whatever the body.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import orjson

from linter.image_parts import PixelBudget

log = logging.getLogger(__name__)


class LintProcess:
    def __init__(self, max_warnings: int = 32, max_warning_bytes: int = 16 * 1024) -> None:
        self.max_warnings = max_warnings
        self.max_warning_bytes = max_warning_bytes
        self.cut_short = 0  # checks stopped by their budget (tests, logs)
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Connection | None = None
        self._owed = 0  # answers the parent stopped waiting for, still to be read
        self._ready = False

    def check(
        self,
        original: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
        canonical: Mapping[str, Any],
        budget_s: float,
        raw: bytes | None = None,
        edits: bool = True,
        pixels: PixelBudget | None = None,
    ) -> list[dict[str, Any]] | None:
        """Warning dicts, or None when the budget ran out (the process is then killed).

        ``raw``, the client's JSON bytes of ``original`` (its ``cache_salt`` is dropped
        there), is sent instead of re-encoding ``original``. ``pixels`` bounds the
        image pixels the child decodes (:func:`linter.image_parts.pixel_budget`; None: no
        bound); its ``used`` grows by what the child decoded (by all that was left when
        the answer does not come back).
        """
        deadline = time.monotonic() + budget_s
        if not self._lock.acquire(timeout=budget_s):
            return None
        try:
            conn = self._ensure_started()
            if not self._settle(conn, deadline):
                return None
            same = canonical == original  # nothing canonicalized: the body crosses once
            raw = raw if raw is not None else orjson.dumps(original)
            remaining = deadline - time.monotonic()
            conn.send_bytes(orjson.dumps(
                [previous, None if same else canonical, self.max_warnings, self.max_warning_bytes, remaining, edits,
                 None if pixels is None else pixels.left]
            ))
            conn.send_bytes(raw)
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                if pixels is not None:
                    pixels.used = pixels.limit
                self.cut_short += 1
                self._owed += 1  # the child's own timer stops it; its null is read next time
                log.warning("prefix check of a %d-byte body exceeded its %.1f s budget; stopped it",
                            len(raw), budget_s)
                return None
            reply = orjson.loads(conn.recv_bytes())
            if reply is None:
                self.cut_short += 1
                if pixels is not None:
                    pixels.used = pixels.limit
                return None
            found: list[dict[str, Any]] = reply[0]
            if pixels is not None:
                pixels.used += reply[1]
            return found
        except (OSError, EOFError, TypeError, orjson.JSONDecodeError):
            log.exception("prefix check process failed; continuing without its warnings")
            self._kill()
            return []
        finally:
            self._lock.release()

    def _settle(self, conn: Connection, deadline: float) -> bool:
        """Wait (until ``deadline``) for the child to be ready and to have answered every
        earlier body; False if it is not (a stuck child is replaced)."""
        while not self._ready or self._owed:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                if self._ready:
                    self._kill()  # owes answers past a whole budget: stuck in C
                return False
            message = conn.recv_bytes()
            if not self._ready:
                self._ready = message == b"ready"
            else:
                self._owed -= 1
        return True

    def stop(self) -> None:
        with self._lock:
            self._kill()

    def _ensure_started(self) -> Connection:
        if self._process is None or not self._process.is_alive() or self._conn is None:
            self._kill()
            context = multiprocessing.get_context("spawn")
            parent, child = context.Pipe()
            self._process = context.Process(target=_serve, args=(child,), name="prefixgate-lint", daemon=True)
            self._process.start()
            child.close()
            self._conn = parent
        return self._conn

    def _kill(self) -> None:
        self._owed, self._ready = 0, False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None


class _Interrupted(BaseException):
    """Raised in the child when its timer fires (BaseException: rules catch Exception)."""


def _serve(conn: Connection) -> None:  # pragma: no cover - runs in the child process
    import contextlib

    from gateway.policy.lint_check import bound_warnings, lint
    from linter.image_parts import pixel_budget

    checking = False

    def interrupt(signum: int, frame: Any) -> None:
        if checking:
            raise _Interrupted

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    with contextlib.suppress(OSError):
        os.nice(10)  # advisory work: the serving process comes first when the CPUs are busy
    signal.signal(signal.SIGALRM, interrupt)
    conn.send_bytes(b"ready")
    while True:
        try:
            header = conn.recv_bytes()
            raw = conn.recv_bytes()
        except EOFError:
            return
        reply = b"null"
        try:
            previous, canonical, max_warnings, max_bytes, budget_s, edits, pixels = orjson.loads(header)
            checking = True
            signal.setitimer(signal.ITIMER_REAL, max(budget_s, 0.001))
            original = orjson.loads(raw)
            original.pop("cache_salt", None)
            if canonical is None:
                canonical = original
            budget = PixelBudget(pixels if pixels is not None else 0)
            with pixel_budget(budget) if pixels is not None else contextlib.nullcontext():
                warnings = bound_warnings(lint(original, previous, canonical, edits), max_warnings, max_bytes)
            reply = orjson.dumps([[warning.to_dict() for warning in warnings], budget.used])
        except _Interrupted:
            pass
        finally:
            checking = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send_bytes(reply)
