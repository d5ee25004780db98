"""What every serving process does once: logging set up, the start-up heap settled, the GIL shared.

Shared by the one-process launcher and each worker of the supervisor.
"""

from __future__ import annotations

import gc
import logging
import sys

from engine.contract.pixel_budget import limit_malloc_arenas


def configure_logging(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # httpx logs every upstream request at INFO; the access log already covers them.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def settle_heap(young_threshold: int = 50_000) -> None:
    """Take what start-up built (modules, the app, its pools) out of the cyclic garbage
    collector's sight, and collect the young generation less often.

    Measured under load (128 clients): a full collection walked every object of the
    start-up heap, 60 ms each time, and the three generations took a quarter of the
    gateway's CPU. Reference counting still frees a request's objects as soon as it
    ends; only reference cycles wait for a collection, and those are few and small.
    Call once, after the app is built, in the process that serves it.

    Also caps the C heap at two malloc arenas (:func:`limit_malloc_arenas`): the
    bodies parsed on worker threads then leave no per-thread arenas behind, and the
    body reader's trim after a burst gives the pages back.
    """
    limit_malloc_arenas(2)
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)


SWITCH_INTERVAL_S = 0.001


def share_the_gil(interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Let a thread waiting for the GIL take it after ``interval_s`` (Python's default: 5 ms).

    Work that grows with a body (parsing it in pieces, canonicalizing, linting the
    previous turn) runs on worker threads as Python, which hands the GIL over only when
    another thread has waited a switch interval for it. The event loop's thread waits
    that long at each wake-up (a socket ready, a timer), several per request: with 5 ms a
    quiet tenant's answer took up to ~100 ms while another tenant's 40,000-message
    bodies were being parsed (``benchmarks/fault_campaign.py --only image_stall``).
    """
    sys.setswitchinterval(interval_s)
