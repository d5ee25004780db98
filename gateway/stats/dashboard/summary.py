"""What the dashboard shows, computed in one pass over ``request_log``.

:func:`summarize` returns plain JSON data (the page's only input):

* ``tenants``: per tenant label (:func:`gateway.policy.tenant_names.labels`: configured names
  as they are, open-mode ids shortened, never a key), the
  :class:`~gateway.stats.report.HitRate` figures of the window plus ``saved_tokens``
  and ``saved_cost``;
* ``series``: for the :data:`CHART_TENANTS` tenants with the most requests, and
  ``(others)`` for the rest together, one point per UTC hour that had requests
  (``hour``, ``requests``, ``prompt_tokens``, ``cached_tokens``, ``hit_rate``), so a
  chart never needs more colours than it has;
* ``warnings``: the most frequent prefix-warning codes with their counts;
* ``slowest``: the streamed requests with the longest time to first token (a
  non-streamed request has no first token before its whole answer), with their
  latency beside it;
* ``totals`` and ``prices``.

Invariants: hit rates follow :mod:`gateway.stats.report` (rows with unknown cached
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

from gateway.config.config_file import GatewayConfig
from gateway.policy.tenant_names import labels
from gateway.stats.report import NO_TENANT, HitRate, read_rows

DEFAULT_HOURS = 7 * 24
MAX_HOURS = 90 * 24
TOP_WARNINGS = 10
SLOWEST = 10
CHART_TENANTS = 10
OTHERS = "(others)"  # not a valid tenant name, so never a tenant's


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
        if row.stream and row.ttft_ms is not None:
            entry = (row.ttft_ms, -index, {
                "time": row.time.strftime("%Y-%m-%d %H:%M:%S"), "tenant": tenant, "model": row.model,
                "ttft_ms": round(row.ttft_ms, 1),
                "latency_ms": None if row.latency_ms is None else round(row.latency_ms, 1),
                "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
            })
            if len(slowest) < SLOWEST:
                heapq.heappush(slowest, entry)
            else:
                heapq.heappushpop(slowest, entry)
    label = labels(tenants)
    by_label: dict[str, HitRate] = {}
    for name, stats in tenants.items():
        by_label.setdefault(label[name], HitRate()).merge(stats)
    charted = set(sorted(by_label, key=lambda name: (-by_label[name].requests, name))[:CHART_TENANTS])
    points: dict[tuple[str, str], HitRate] = {}
    for (name, hour), stats in hourly.items():
        line = label[name] if label[name] in charted else OTHERS
        points.setdefault((line, hour), HitRate()).merge(stats)
    series: dict[str, list[dict[str, Any]]] = {}
    for (line, hour), stats in sorted(points.items(), key=lambda item: (item[0][0] == OTHERS, item[0])):
        series.setdefault(line, []).append({
            "hour": hour, "requests": stats.requests, "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens, "hit_rate": stats.hit_rate,
        })
    for _, _, slow in slowest:
        slow["tenant"] = label[slow["tenant"]]
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
            for name, stats in sorted(by_label.items())
        },
        "series": series,
        "warnings": [{"code": code, "count": count}
                     for code, count in sorted(warnings.items(), key=lambda item: (-item[1], item[0]))[:TOP_WARNINGS]],
        "slowest": [entry for _, _, entry in sorted(slowest, reverse=True)],
    }
