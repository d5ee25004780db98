"""How many image pixels the prefix check may decode for a tenant's request.

Naming an image for the warnings (:mod:`linter.image_parts`) decodes and hashes its
pixels: ~30 ms of CPU for a 2048x2048 image, and nine such images fit in an 8 KiB
body. So each tenant has a token bucket of pixels: it refills at ``per_second``
up to ``per_second`` (one second's worth), and one request may decode at most
``per_request`` of what is in it (:meth:`PixelRate.allowance`); what the check
decoded is then taken out (:meth:`PixelRate.charge`). Images past the allowance are
named by a hash of their bytes instead: warnings stay correct for images sent the
same way twice, only a re-encoded copy of an image is then seen as changed.

Invariants: a tenant's bucket never holds more than ``per_second`` nor less than 0;
at most ``max_tenants`` buckets are kept (least recently used dropped: a dropped
tenant starts full again, which lets it decode at most one more second's worth).
Not thread-safe: the event loop alone calls it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_PER_REQUEST = 2 * 2048 * 2048
DEFAULT_PER_SECOND = 4 * 2048 * 2048


class PixelRate:
    def __init__(
        self,
        per_request: int = DEFAULT_PER_REQUEST,
        per_second: int = DEFAULT_PER_SECOND,
        max_tenants: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_request < 0 or per_second < 0:
            raise ValueError(f"pixel budgets must be >= 0, got {per_request!r} per request, "
                             f"{per_second!r} per second")
        self.per_request = per_request
        self.per_second = per_second
        self.max_tenants = max_tenants
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (pixels, at)

    def _level(self, tenant: str) -> float:
        now = self._clock()
        pixels, at = self._buckets.pop(tenant, (float(self.per_second), now))
        pixels = min(float(self.per_second), pixels + (now - at) * self.per_second)
        self._buckets[tenant] = (pixels, now)
        if len(self._buckets) > self.max_tenants:
            self._buckets.popitem(last=False)
        return pixels

    def allowance(self, tenant: str) -> int:
        """Pixels ``tenant``'s next request may decode now (does not take them)."""
        return int(min(self.per_request, self._level(tenant)))

    def charge(self, tenant: str, pixels: int) -> None:
        """Take ``pixels`` decoded for ``tenant`` out of its bucket (not below 0)."""
        level = self._level(tenant)
        self._buckets[tenant] = (max(0.0, level - pixels), self._clock())
