"""``prefixgate gateway``: the OpenAI-compatible proxy in front of an upstream engine."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from gateway.launcher import add_common_options

EPILOG = """example:
  prefixgate gateway --upstream http://127.0.0.1:8001 --config gateway.toml --port 8000 --workers 2
  # then: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="<tenant key>")
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
    parser.add_argument("--upstream", default=None, help="upstream base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument(
        "--workers", type=_positive, default=None,
        help="worker processes sharing the port, stats, metrics and warning history (default: the number of cores)",
    )
    add_common_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gateway.launcher import build_settings, fail, run_gateway
    from gateway.supervisor import default_workers

    try:
        settings = build_settings(args, args.upstream)
    except ValueError as exc:
        return fail(str(exc))
    workers = args.workers if args.workers is not None else default_workers()
    # uvicorn shuts down gracefully, then re-raises SIGINT as KeyboardInterrupt.
    with contextlib.suppress(KeyboardInterrupt):
        return run_gateway(settings, args.host, args.port, args.log_level, workers)
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)
