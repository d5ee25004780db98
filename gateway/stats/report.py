"""Hit-rate aggregates over ``request_log``.

The hit rate is ``sum(cached_tokens) / sum(prompt_tokens)`` over the rows whose
``cached_tokens`` is known; rows with unknown cached tokens are counted separately
(``unknown_cached``) and left out of the rate, so an upstream that does not report
hits never looks like a 0% hit rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select

from gateway.policy.tenant_names import labels
from gateway.stats.table import request_log

NO_TENANT = "(unauthenticated)"


@dataclass
class HitRate:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    unknown_cached: int = 0
    known_prompt_tokens: int = 0

    def merge(self, other: HitRate) -> None:
        """Add ``other``'s counts to this one (the same as adding its rows here)."""
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.unknown_cached += other.unknown_cached
        self.known_prompt_tokens += other.known_prompt_tokens

    def add(self, row: Any) -> None:
        self.requests += 1
        if row.status >= 400:
            self.errors += 1
        self.prompt_tokens += row.prompt_tokens or 0
        self.completion_tokens += row.completion_tokens or 0
        if row.cached_tokens is None:
            if row.prompt_tokens is not None:
                self.unknown_cached += 1
        else:
            self.cached_tokens += row.cached_tokens
            self.known_prompt_tokens += row.prompt_tokens or 0

    @property
    def hit_rate(self) -> float | None:
        if self.known_prompt_tokens == 0:
            return None
        return self.cached_tokens / self.known_prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "requests_with_unknown_cached_tokens": self.unknown_cached,
            "hit_rate": self.hit_rate,
        }


def read_rows(engine: Engine, since: datetime | None) -> Iterable[Any]:
    """``request_log`` rows at or after ``since``, streamed in batches (the columns reports use)."""
    query = select(
        request_log.c.time,
        request_log.c.tenant,
        request_log.c.model,
        request_log.c.status,
        request_log.c.stream,
        request_log.c.prompt_tokens,
        request_log.c.cached_tokens,
        request_log.c.completion_tokens,
        request_log.c.ttft_ms,
        request_log.c.latency_ms,
        request_log.c.warning_codes,
        request_log.c.replica,
        request_log.c.predicted_cached_tokens,
    )
    if since is not None:
        query = query.where(request_log.c.time >= since)
    with engine.connect() as connection:
        yield from connection.execute(query.execution_options(yield_per=1000))


def per_tenant(engine: Engine, since: datetime | None = None) -> dict[str, HitRate]:
    result: dict[str, HitRate] = {}
    for row in read_rows(engine, since):
        result.setdefault(row.tenant or NO_TENANT, HitRate()).add(row)
    return dict(sorted(result.items()))


def per_tenant_model_hour(
    engine: Engine, since: datetime | None = None
) -> dict[tuple[str, str, str], HitRate]:
    """Hit rates per (tenant label, model, hour): open-mode ids shortened as on the dashboard
    (:func:`gateway.policy.tenant_names.labels`)."""
    by_id: dict[tuple[str, str, str], HitRate] = {}
    for row in read_rows(engine, since):
        hour = row.time.strftime("%Y-%m-%d %H:00")
        key = (row.tenant or NO_TENANT, row.model or "-", hour)
        by_id.setdefault(key, HitRate()).add(row)
    label = labels(tenant for tenant, _, _ in by_id)
    result: dict[tuple[str, str, str], HitRate] = {}
    for (tenant, model, hour), stats in by_id.items():
        result.setdefault((label[tenant], model, hour), HitRate()).merge(stats)
    return dict(sorted(result.items()))


@dataclass
class ReplicaHits(HitRate):
    """A replica's hit rate plus the gateway's predictions, over rows that have both numbers."""

    compared: int = 0
    exact: int = 0
    predicted_tokens: int = 0
    reported_tokens: int = 0

    def add(self, row: Any) -> None:
        super().add(row)
        if row.predicted_cached_tokens is not None and row.cached_tokens is not None:
            self.compared += 1
            self.exact += row.predicted_cached_tokens == row.cached_tokens
            self.predicted_tokens += row.predicted_cached_tokens
            self.reported_tokens += row.cached_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "predicted_requests": self.compared, "exact_predictions": self.exact,
                "predicted_cached_tokens": self.predicted_tokens, "reported_cached_tokens": self.reported_tokens}


def per_replica(engine: Engine, since: datetime | None = None) -> dict[str, ReplicaHits]:
    """Hit rates and prediction accuracy per replica (``-`` for rows without one)."""
    result: dict[str, ReplicaHits] = {}
    for row in read_rows(engine, since):
        result.setdefault(row.replica or "-", ReplicaHits()).add(row)
    return dict(sorted(result.items()))


def format_replica_table(groups: dict[str, ReplicaHits]) -> str:
    header = ("replica", "requests", "errors", "prompt", "cached", "hit rate", "predicted", "exact")
    lines = [list(header)]
    for name, stats in groups.items():
        rate = "unknown" if stats.hit_rate is None else f"{stats.hit_rate:.1%}"
        exact = f"{stats.exact}/{stats.compared}" if stats.compared else "-"
        lines.append([name, str(stats.requests), str(stats.errors), str(stats.prompt_tokens),
                      str(stats.cached_tokens), rate, str(stats.predicted_tokens), exact])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def format_table(groups: dict[tuple[str, str, str], HitRate]) -> str:
    header: Sequence[str] = ("tenant", "model", "hour (UTC)", "requests", "errors", "prompt", "cached", "hit rate")
    lines = [list(header)]
    for (tenant, model, hour), stats in groups.items():
        rate = "unknown" if stats.hit_rate is None else f"{stats.hit_rate:.1%}"
        lines.append(
            [tenant, model, hour, str(stats.requests), str(stats.errors),
             str(stats.prompt_tokens), str(stats.cached_tokens), rate]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)
