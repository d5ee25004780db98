"""A helper process that runs the linter on large request bodies and can be killed.

The linter's per-request rules do work that grows faster than the body (a 7.5 MiB
system prompt full of dates took 9-25 s and produced 429k findings; 64 KiB of
dense dates 170 ms). A thread
cannot be stopped, and a thread running pure Python holds the GIL for its 5 ms
slices, delaying every other request of the process. So the gateway sends large
bodies here, waits at most the check's budget, and kills the process when the
budget runs out (a fresh one starts with the next large body).

One check at a time (a lock); a caller that cannot get the process within its
budget gives up. The child bounds its findings (``bound_warnings``) before
sending them back, so the reply is small whatever the body.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import orjson

log = logging.getLogger(__name__)


class LintProcess:
    def __init__(self, max_warnings: int = 32, max_warning_bytes: int = 16 * 1024) -> None:
        self.max_warnings = max_warnings
        self.max_warning_bytes = max_warning_bytes
        self.kills = 0  # checks cut short by their budget (tests, logs)
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Connection | None = None

    def check(
        self,
        original: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
        canonical: Mapping[str, Any],
        budget_s: float,
    ) -> list[dict[str, Any]] | None:
        """Warning dicts, or None when the budget ran out (the process is then killed)."""
        deadline = time.monotonic() + budget_s
        if not self._lock.acquire(timeout=budget_s):
            return None
        try:
            same = canonical == original  # nothing canonicalized: send the body once
            payload = orjson.dumps(
                [original, previous, None if same else canonical, self.max_warnings, self.max_warning_bytes]
            )
            conn = self._ensure_started()
            conn.send_bytes(payload)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not conn.poll(remaining):
                self.kills += 1
                log.warning("prefix check of a %d-byte body exceeded its %.1f s budget; stopped it",
                            len(payload), budget_s)
                self._kill()
                return None
            found: list[dict[str, Any]] = orjson.loads(conn.recv_bytes())
            return found
        except (OSError, EOFError, TypeError, orjson.JSONDecodeError):
            log.exception("prefix check process failed; continuing without its warnings")
            self._kill()
            return []
        finally:
            self._lock.release()

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
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None


def _serve(conn: Connection) -> None:  # pragma: no cover - runs in the child process
    import signal

    from gateway.prefix_warner import bound_warnings, lint

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    while True:
        try:
            original, previous, canonical, max_warnings, max_bytes = orjson.loads(conn.recv_bytes())
        except EOFError:
            return
        canonical = original if canonical is None else canonical
        warnings = bound_warnings(lint(original, previous, canonical), max_warnings, max_bytes)
        conn.send_bytes(orjson.dumps([warning.to_dict() for warning in warnings]))
