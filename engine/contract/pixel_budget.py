"""PixelBudget: how many decoded image pixels the server's requests may hold at once.

Each image respects :data:`engine.contract.image_content.MAX_IMAGE_PIXELS`, but requests
arrive together: eight 6320x6320 PNGs of zeros are a 1.2 MB body and 320 M pixels
once decoded. So a request reserves the pixels of all its images (read from their
headers, before any is decoded) in one piece, and holds them while they are decoded,
hashed and turned into the model's pixel inputs; the reservation ends when the
request is rendered (the decoded images are dropped then). Reserving in one piece
means two requests can never each hold half of what both need.

Beyond the budget a request waits, first come first served, at most ``wait_s``
seconds and behind at most ``max_waiting`` others; then it is refused
(:class:`PixelBudgetBusy`, a 429 for the server). A request needing more than the
whole budget can never run (:class:`PixelBudgetTooSmall`, a 400). Text-only
requests never touch the budget, so they keep being served.

When the last reservation ends, the C heap is trimmed (``malloc_trim(0)`` on glibc):
decoding runs on the server's worker threads, and glibc keeps the freed
megabyte-sized pieces of a decode in each thread's arena instead of returning them,
so without a trim the process stays gigabytes above its idle size after a burst of
large images (measured by ``benchmarks/tenant_pressure.py``).

Invariants: ``in_use <= max_pixels`` at every moment; ``in_use`` is the sum of the
live reservations; thread-safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections import deque

DEFAULT_MAX_PIXELS_IN_FLIGHT = 320_000_000
"""Eight images of 40 M pixels (:data:`engine.contract.image_content.MAX_IMAGE_PIXELS`): one full request."""
DEFAULT_WAIT_S = 30.0
DEFAULT_MAX_WAITING = 8


class PixelBudgetBusy(Exception):
    """The budget stayed full for as long as a request may wait (or too many wait)."""


class PixelBudgetTooSmall(ValueError):
    """A request needs more pixels than the whole budget."""


class PixelBudget:
    """A counting semaphore of pixels with a bounded, first-come-first-served queue."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS_IN_FLIGHT, *, wait_s: float = DEFAULT_WAIT_S,
                 max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {max_pixels!r}")
        if wait_s < 0 or max_waiting < 0:
            raise ValueError(f"wait_s and max_waiting must be >= 0, got {wait_s!r} and {max_waiting!r}")
        self.max_pixels = max_pixels
        self.wait_s = wait_s
        self.max_waiting = max_waiting
        self.in_use = 0
        self.peak = 0
        self.refused = 0
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()

    def acquire(self, pixels: int) -> None:
        """Reserve ``pixels`` (> 0), waiting within the bounds; raises
        :class:`PixelBudgetTooSmall` or :class:`PixelBudgetBusy` instead, changing
        nothing. Every successful call is paired with one :meth:`release`."""
        if pixels > self.max_pixels:
            raise PixelBudgetTooSmall(
                f"the images of this request have {pixels} pixels, more than the engine holds at once "
                f"({self.max_pixels}, --max-image-pixels-in-flight)")
        deadline = time.monotonic() + self.wait_s
        ticket = object()
        with self._cond:
            if not self._queue and self.in_use + pixels <= self.max_pixels:
                self._take(pixels)
                return
            if len(self._queue) >= self.max_waiting:
                self.refused += 1
                raise PixelBudgetBusy(f"{len(self._queue)} image requests are already waiting")
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self.in_use + pixels <= self.max_pixels):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.refused += 1
                        raise PixelBudgetBusy(f"the images of requests in flight held the budget for "
                                              f"{self.wait_s:g} s")
                    self._cond.wait(left)
                self._take(pixels)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _take(self, pixels: int) -> None:
        self.in_use += pixels
        self.peak = max(self.peak, self.in_use)

    def release(self, pixels: int) -> None:
        """End a reservation of ``pixels``; trims the C heap when none is left."""
        with self._cond:
            self.in_use -= pixels
            idle = self.in_use == 0
            self._cond.notify_all()
        if idle:
            trim_heap()


def _load_glibc(function: str, argtypes: list[type]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        found = getattr(ctypes.CDLL(name or "libc.so.6"), function)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    found.argtypes = argtypes
    found.restype = ctypes.c_int
    return found


_MALLOC_TRIM = _load_glibc("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _load_glibc("mallopt", [ctypes.c_int, ctypes.c_int])
_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(count: int) -> bool:
    """Let glibc's malloc create at most ``count`` arenas from now on (``mallopt
    M_ARENA_MAX``); False where there is no such call. By default every thread that
    allocates may get an arena of its own, and a large body parsed on a worker thread
    leaves its pages there: after a burst over many threads the process kept ~3x its
    idle RSS (``benchmarks/gateway_memory.py``), with two arenas and :func:`trim_heap`
    1.14x."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_ARENA_MAX, count))


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``, every
    arena); False where there is no such call."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
