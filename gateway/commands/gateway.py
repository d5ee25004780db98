"""``prefixgate gateway``: the OpenAI-compatible proxy in front of an upstream engine."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from gateway.config.replica_spec import add_routing_options
from gateway.server.launcher import add_common_options

EPILOG = """examples:
  prefixgate gateway --upstream http://127.0.0.1:8001 --config gateway.toml --port 8000 --workers 2
  prefixgate gateway --upstream http://127.0.0.1:8001,events=tcp://127.0.0.1:5557 \
                     --upstream http://127.0.0.1:8002,events=tcp://127.0.0.1:5567   # see docs/routing.md
  # then: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="<tenant key>")
  OPENAI_API_KEY=sk-... prefixgate gateway --upstream https://api.openai.com/v1 --upstream-kind openai
  prefixgate gateway --upstream http://127.0.0.1:8080 --upstream-kind llamacpp --allow-shared-cache
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="run the caching gateway in front of an OpenAI-compatible upstream",
        description="Proxy OpenAI requests with tenants, server-side cache salts, "
        "canonicalization, prefix warnings and hit statistics.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--upstream", action="append", default=[],
                        help="upstream base URL, e.g. http://127.0.0.1:8001; repeat it for several replicas, "
                        "optionally with ,events=ZMQ_ENDPOINT[,replay=ZMQ_ENDPOINT]")
    parser.add_argument(
        "--upstream-kind", choices=["vllm", "openai", "llamacpp"], default=None,
        help="vllm: send cache_salt (vLLM, SGLang, prefixgate engine); openai: send a derived "
        "prompt_cache_key instead (OpenAI's API); llamacpp: llama.cpp's llama-server, which ignores "
        "cache_salt (see --allow-shared-cache). Default: openai for api.openai.com, else vllm",
    )
    parser.add_argument(
        "--allow-shared-cache", action="store_true",
        help="start in front of an upstream that cannot isolate tenants (--upstream-kind llamacpp) "
        "even though tenants ask for isolation: ALL TENANTS THEN SHARE ITS PROMPT CACHE "
        "(one tenant's timing can reveal another's prompts)",
    )
    parser.add_argument(
        "--workers", type=_positive, default=None,
        help="worker processes sharing the port, stats, metrics and warning history (default: the number of cores)",
    )
    add_common_options(parser)
    add_routing_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os

    from gateway.config.replica_spec import parse_upstream_arg
    from gateway.server.launcher import build_settings, fail, run_gateway
    from gateway.server.ports import ensure_free
    from gateway.server.process_setup import configure_logging
    from gateway.server.supervisor import default_workers
    from gateway.stats.metrics import METRICS_HOST
    from gateway.upstream.kinds import API_KEY_ENV, check_isolation, resolve_kind

    try:
        ensure_free(args.host, args.port, "gateway")
        if args.metrics_port is not None:
            ensure_free(METRICS_HOST, args.metrics_port, "metrics")
        replicas = [parse_upstream_arg(value, i) for i, value in enumerate(args.upstream)]
        settings = build_settings(args, None, replicas)
        kind = resolve_kind(args.upstream_kind or settings.config.upstream_kind, settings.upstream)
        api_key = os.environ.get(API_KEY_ENV) or (os.environ.get("OPENAI_API_KEY") if kind == "openai" else None)
        if kind == "openai" and not api_key:
            raise ValueError(f"--upstream-kind openai needs an API key: set OPENAI_API_KEY or {API_KEY_ENV}")
        problem = check_isolation(kind, settings.config.tenants.values(), settings.open_mode, args.allow_shared_cache)
        if problem is not None:
            raise ValueError(problem)
    except ValueError as exc:
        return fail(str(exc))
    if args.allow_shared_cache and check_isolation(kind, settings.config.tenants.values(), settings.open_mode,
                                                   False) is not None:
        configure_logging(args.log_level)
        logging.getLogger("prefixgate.gateway").warning(
            "--allow-shared-cache: upstream kind %s cannot isolate tenants; ALL TENANTS SHARE ITS PROMPT CACHE",
            kind)
    settings = dataclasses.replace(settings, upstream_kind=kind, upstream_api_key=api_key)
    workers = args.workers if args.workers is not None else default_workers()
    # uvicorn shuts down gracefully, then re-raises SIGINT as KeyboardInterrupt.
    with contextlib.suppress(KeyboardInterrupt):
        return run_gateway(settings, args.host, args.port, args.log_level, workers)
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)
