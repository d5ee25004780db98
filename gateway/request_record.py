"""One request's statistics row, filled in as the request goes through the gateway."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass
class RequestRecord:
    """Mutable while the request runs; handed to the stats writer exactly once."""

    endpoint: str
    upstream: str
    started: float = field(default_factory=time.perf_counter)
    time: datetime = field(default_factory=lambda: datetime.now(UTC).replace(tzinfo=None))
    tenant: str | None = None
    model: str | None = None
    status: int = 0
    stream: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    warning_codes: list[str] = field(default_factory=list)
    canonicalization: list[str] = field(default_factory=list)
    error_code: str | None = None
    replica: str | None = None
    predicted_cached_tokens: int | None = None
    route: Any = field(default=None, repr=False, compare=False)  # gateway.routing.replicas.Route, not a column

    def mark_first_byte(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.started) * 1000.0

    def finish(self, status: int, error_code: str | None = None) -> None:
        self.status = status
        self.error_code = error_code
        self.latency_ms = (time.perf_counter() - self.started) * 1000.0

    def take_usage(self, usage: Any) -> None:
        """Copy token counts from an OpenAI ``usage`` object (chat and completions'
        ``prompt_tokens``..., or the Responses API's ``input_tokens``...); absent values stay None."""
        if not isinstance(usage, dict):
            return
        if "input_tokens" in usage:  # the Responses API's names
            usage = {"prompt_tokens": usage.get("input_tokens"),
                     "completion_tokens": usage.get("output_tokens"),
                     "prompt_tokens_details": usage.get("input_tokens_details")}
        self.prompt_tokens = _count(usage.get("prompt_tokens"))
        self.completion_tokens = _count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.cached_tokens = _count(details.get("cached_tokens"))

    def to_row(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "model": self.model,
            "upstream": self.upstream,
            "status": self.status,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": self.ttft_ms,
            "latency_ms": self.latency_ms,
            "warning_codes": ",".join(sorted(set(self.warning_codes))),
            "canonicalization": ",".join(self.canonicalization),
            "error_code": self.error_code,
            "replica": self.replica,
            "predicted_cached_tokens": self.predicted_cached_tokens,
        }


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
