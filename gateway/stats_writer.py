"""The batched background writer of ``request_log`` rows.

The event loop only calls :meth:`StatsWriter.submit` (a non-blocking queue put).
A dedicated thread drains the queue and inserts rows in batches of up to
``batch_size`` in one transaction; after the first row of a batch it waits up to
``max_delay_s`` for more, so a busy gateway writes many rows per transaction
instead of holding the GIL for one insert per request. :meth:`close` (called from the app's lifespan
on graceful shutdown) drains every queued row before it returns, so no row is
lost. A failed insert is retried once per batch and then logged with the number
of rows dropped (counted in :attr:`dropped`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from sqlalchemy import Engine, insert

from gateway.request_record import RequestRecord
from gateway.stats_table import request_log

log = logging.getLogger(__name__)

_STOP = object()


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


class StatsWriter:
    def __init__(self, engine: Engine, *, batch_size: int = 256, max_delay_s: float = 0.25) -> None:
        self.engine = engine
        self.batch_size = batch_size
        self.max_delay_s = max_delay_s
        self.written = 0
        self.dropped = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="prefixgate-stats", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, record: RequestRecord) -> None:
        """Queue one row; never blocks and never raises."""
        self._queue.put(record.to_row())

    def flush(self, timeout: float | None = None) -> bool:
        """Block (call from a thread, not the event loop) until queued rows are written."""
        marker = _Flush()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def close(self) -> None:
        """Write every queued row, then stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch: list[dict[str, Any]] = []
            flushes: list[_Flush] = []
            item = self._queue.get()
            deadline = time.monotonic() + self.max_delay_s
            while True:
                if item is _STOP:
                    stopping = True
                elif isinstance(item, _Flush):
                    flushes.append(item)
                else:
                    batch.append(item)
                if stopping or flushes or len(batch) >= self.batch_size:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            if stopping:
                batch.extend(self._drain(flushes))
            self._write(batch)
            for marker in flushes:
                marker.done.set()

    def _drain(self, flushes: list[_Flush]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return rows
            if isinstance(item, _Flush):
                flushes.append(item)
            elif item is not _STOP:
                rows.append(item)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        for attempt in (1, 2):
            try:
                with self.engine.begin() as connection:
                    connection.execute(insert(request_log), rows)
                self.written += len(rows)
                return
            except Exception:
                if attempt == 2:
                    self.dropped += len(rows)
                    log.exception("could not write %d stats rows; dropped", len(rows))
