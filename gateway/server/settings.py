"""Everything a gateway app needs to start, resolved from the command line and config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gateway.config.config_file import GatewayConfig
from gateway.config.replica_spec import ReplicaSpec, RoutingOptions
from gateway.responses.store import ResponseLimits


@dataclass(frozen=True)
class GatewaySettings:
    """``config`` holds the tenants; ``open_mode`` is True when no config file was given.

    ``upstream_kind`` is one of :data:`gateway.upstream.kinds.UPSTREAM_KINDS`;
    ``upstream_api_key`` (never logged) is sent as a bearer token to the upstream.
    """

    upstream: str
    secret: bytes
    db_url: str
    config: GatewayConfig = field(default_factory=GatewayConfig)
    open_mode: bool = True
    data_dir: Path = Path(".prefixgate")
    stats_batch_size: int = 256
    upstream_kind: str = "vllm"
    upstream_api_key: str | None = None
    replicas: tuple[ReplicaSpec, ...] = ()  # empty: the single ``upstream``
    routing: RoutingOptions = field(default_factory=RoutingOptions)
    startup_warnings: tuple[str, ...] = ()  # logged once at start (e.g. a secret file others can read)
    metrics_port: int | None = None  # unauthenticated /metrics on 127.0.0.1 (metrics.MetricsListener)
    responses: ResponseLimits = field(default_factory=ResponseLimits)  # the Responses state API

    def replica_specs(self) -> tuple[ReplicaSpec, ...]:
        return self.replicas or (ReplicaSpec(self.upstream, "r0"),)
