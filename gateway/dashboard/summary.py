"""What the dashboard shows, computed in one pass over ``request_log``.

:func:`summarize` returns plain JSON data (the page's only input):

* ``tenants``: per tenant, the :class:`~gateway.stats_report.HitRate` figures of the
  window plus ``saved_tokens`` and ``saved_cost``;
* ``series``: per tenant, one point per UTC hour that had requests
  (``hour``, ``requests``, ``prompt_tokens``, ``cached_tokens``, ``hit_rate``);
* ``warnings``: the most frequent prefix-warning codes with their counts;
* ``slowest``: the requests with the longest time to first token;
* ``totals`` and ``prices``.

Invariants: hit rates follow :mod:`gateway.stats_report` (rows with unknown cached
tokens are left out of the rate, never counted as misses); the work is one
streamed scan of the window (at most :data:`MAX_HOURS`) plus bounded heaps, so
memory does not grow with the number of rows. ``saved_cost`` is an estimate:
cached tokens times the difference between the uncached and the cached price per
million tokens from the config.
"""

from __future__ import annotations

import heapq
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from gateway.config import GatewayConfig
from gateway.stats_report import NO_TENANT, HitRate, read_rows

DEFAULT_HOURS = 7 * 24
MAX_HOURS = 90 * 24
TOP_WARNINGS = 10
SLOWEST = 10


def saved_cost(cached_tokens: int, config: GatewayConfig) -> float:
    """Estimated cost saved by ``cached_tokens`` at the config's prices."""
    discount = config.input_price_per_million - config.cached_input_price_per_million
    return cached_tokens * discount / 1_000_000


def parse_hours(value: str | None) -> int:
    """The window in hours from a query parameter; ``ValueError`` naming the bad value."""
    if value is None:
        return DEFAULT_HOURS
    if not value.isdigit() or not 1 <= int(value) <= MAX_HOURS:
        raise ValueError(f"hours must be a whole number from 1 to {MAX_HOURS}, got {value!r}")
    return int(value)


def summarize(engine: Engine, config: GatewayConfig, hours: int, now: datetime | None = None) -> dict[str, Any]:
    now = now or datetime.now(UTC).replace(tzinfo=None)  # rows hold naive UTC times
    since = (now - timedelta(hours=hours)).replace(minute=0, second=0, microsecond=0)
    tenants: dict[str, HitRate] = {}
    hourly: dict[tuple[str, str], HitRate] = {}
    warnings: dict[str, int] = {}
    slowest: list[tuple[float, int, dict[str, Any]]] = []
    total = HitRate()
    for index, row in enumerate(read_rows(engine, since)):
        tenant = row.tenant or NO_TENANT
        for stats in (tenants.setdefault(tenant, HitRate()),
                      hourly.setdefault((tenant, row.time.strftime("%Y-%m-%dT%H:00")), HitRate()), total):
            stats.add(row)
        for code in filter(None, (row.warning_codes or "").split(",")):
            warnings[code] = warnings.get(code, 0) + 1
        if row.ttft_ms is not None:
            entry = (row.ttft_ms, -index, {
                "time": row.time.strftime("%Y-%m-%d %H:%M:%S"), "tenant": tenant, "model": row.model,
                "ttft_ms": round(row.ttft_ms, 1), "prompt_tokens": row.prompt_tokens,
                "cached_tokens": row.cached_tokens, "stream": bool(row.stream),
            })
            if len(slowest) < SLOWEST:
                heapq.heappush(slowest, entry)
            else:
                heapq.heappushpop(slowest, entry)
    series: dict[str, list[dict[str, Any]]] = {}
    for (tenant, hour), stats in sorted(hourly.items()):
        series.setdefault(tenant, []).append({
            "hour": hour, "requests": stats.requests, "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens, "hit_rate": stats.hit_rate,
        })
    return {
        "generated": now.strftime("%Y-%m-%d %H:%M UTC"),
        "since": since.strftime("%Y-%m-%dT%H:00"),
        "hours": hours,
        "prices": {"input_per_million": config.input_price_per_million,
                   "cached_input_per_million": config.cached_input_price_per_million},
        "totals": {**total.to_dict(), "saved_tokens": total.cached_tokens,
                   "saved_cost": saved_cost(total.cached_tokens, config)},
        "tenants": {
            name: {**stats.to_dict(), "saved_tokens": stats.cached_tokens,
                   "saved_cost": saved_cost(stats.cached_tokens, config)}
            for name, stats in sorted(tenants.items())
        },
        "series": series,
        "warnings": [{"code": code, "count": count}
                     for code, count in sorted(warnings.items(), key=lambda item: (-item[1], item[0]))[:TOP_WARNINGS]],
        "slowest": [entry for _, _, entry in sorted(slowest, reverse=True)],
    }
