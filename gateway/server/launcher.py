"""Turning command-line options into a running gateway (shared by ``gateway`` and ``serve``).

Start-up order: load the config (``ValueError`` -> exit 2), resolve the secret
(config, ``$PREFIXGATE_SECRET`` or ``<data-dir>/secret``), upgrade the stats
database to the newest Alembic revision, then run uvicorn. Without a config the
gateway runs in open mode and says so.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.config.config_file import GatewayConfig, load_config
from gateway.config.replica_spec import (
    ReplicaSpec,
    check_unique,
    normalize_base_url,
    routing_from_args,
)
from gateway.server.process_setup import configure_logging, settle_heap, share_the_gil
from gateway.server.settings import GatewaySettings

log = logging.getLogger("prefixgate.gateway")

DATA_DIR_ENV = "PREFIXGATE_DATA_DIR"


def default_data_dir() -> Path:
    return Path(os.environ.get(DATA_DIR_ENV, ".prefixgate"))


def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="TOML file with [server] and [tenants.*]")
    parser.add_argument(
        "--data-dir", type=Path, default=None,
        help=f"secret and stats database directory (default ${DATA_DIR_ENV} or ./.prefixgate)",
    )
    parser.add_argument("--db-url", default=None, help="SQLAlchemy URL of the stats database "
                        "(default sqlite:///DATA_DIR/prefixgate.db)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="also serve /metrics without a key on 127.0.0.1:PORT, for Prometheus "
                        "(the gateway's own /metrics needs an admin key)")
    parser.add_argument("--responses-ttl", default="30d", metavar="DURATION",
                        help="how long stored Responses (store: true, the default) are kept for "
                        "previous_response_id and GET /v1/responses/{id}: seconds or 90m, 12h, 30d "
                        "(default 30d, as OpenAI; 0 keeps none)")
    parser.add_argument("--responses-max-turns", type=_whole, default=1000, metavar="N",
                        help="longest previous_response_id chain; a longer one is a 400 (default 1000)")
    parser.add_argument("--responses-max-bytes", type=_whole, default=None, metavar="BYTES",
                        help="largest input of a continued conversation, in bytes of input items "
                        "(default: the body limit, [server] max_body_bytes)")


def build_settings(args: argparse.Namespace, upstream: str | None,
                   replicas: Sequence[ReplicaSpec] = ()) -> GatewaySettings:
    """Settings from parsed options; ``ValueError`` for a bad config or a missing upstream.

    ``replicas`` (several ``--upstream``) win over the config's ``[[upstreams]]``."""
    from gateway.policy.salt import exposed_secret_warning, load_or_create_secret, secret_files
    from gateway.responses.store import ResponseLimits, parse_ttl
    from gateway.stats.database import default_db_url

    config = load_config(args.config) if args.config is not None else GatewayConfig()
    replicas = check_unique(replicas) or config.upstreams
    upstream = upstream or config.upstream or (replicas[0].url if replicas else None)
    if not upstream:
        raise ValueError("no upstream: pass --upstream URL or set [server] upstream in the config")
    data_dir = args.data_dir or default_data_dir()
    secret = load_or_create_secret(data_dir, config.secret)
    exposed = (exposed_secret_warning(path) for path in secret_files(data_dir, args.config, config.secret))
    responses = ResponseLimits(parse_ttl(args.responses_ttl), args.responses_max_turns,
                               args.responses_max_bytes or config.max_body_bytes)
    return GatewaySettings(
        upstream=normalize_base_url(upstream),
        secret=secret,
        startup_warnings=tuple(line for line in exposed if line is not None),
        db_url=args.db_url or default_db_url(data_dir),
        config=config,
        open_mode=args.config is None,
        data_dir=data_dir,
        replicas=tuple(replicas),
        routing=routing_from_args(args, config.routing),
        metrics_port=args.metrics_port,
        responses=responses,
    )


def run_gateway(
    settings: GatewaySettings, host: str, port: int, log_level: str = "info", workers: int = 1
) -> int:
    """Upgrade the database and serve until SIGINT/SIGTERM (blocking); the exit status.

    ``workers`` > 1 runs that many processes on one socket (``supervisor.py``).
    """
    import uvicorn

    from gateway.config import runtime_dir
    from gateway.server.app import create_app
    from gateway.stats import database

    configure_logging(log_level)
    runtime_dir.clean_stale()  # what a run killed with SIGKILL left in the temp dir
    database.upgrade(settings.db_url)
    for line in settings.startup_warnings:
        log.warning("%s", line)
    if settings.open_mode:
        log.warning(
            "no --config: OPEN MODE for local use -- every distinct bearer token is its own "
            "isolated tenant and no key is checked"
        )
    else:
        log.info("%d tenant(s) configured", len(settings.config.tenants))
    log.info("upstream %s, stats in %s", settings.upstream, settings.db_url)
    if workers > 1:
        from gateway.server.supervisor import serve_workers

        return serve_workers(settings, host, port, log_level, workers)
    app = create_app(settings)
    settle_heap()
    share_the_gil()
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on")
    return 0


def _whole(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def fail(message: str) -> int:
    print(f"prefixgate: error: {message}", file=sys.stderr)
    return 2
