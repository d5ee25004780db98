"""``prefixgate serve``: the bundled engine as a child process with the gateway in front."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.config.replica_spec import add_routing_options
from gateway.server.launcher import add_common_options

EPILOG = """examples:
  prefixgate serve --port 8000 --engine-port 8001
  prefixgate serve --replicas 3 --engine-arg=--kv-cache-memory=0.05   # engines on 8001-8003
  prefixgate serve --kv-offload-dir ~/.cache/prefixgate/kv --kv-offload-size 20   # warm after a restart
  prefixgate serve --metrics-port 9100   # Prometheus scrapes 127.0.0.1:9100/metrics without a key
  prefixgate serve --responses-ttl 12h   # keep stored Responses (previous_response_id) 12 hours
  # OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="anything") in open mode
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start the bundled engine and the gateway in front of it",
        description="Start 'prefixgate engine' as a child process, wait until it is healthy, "
        "then run the gateway in front of it. Ctrl-C stops both. The engine answers only the "
        "gateway: it gets a random API key for this run, which only the gateway is given.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_options(parser)
    parser.add_argument("--engine-port", type=int, default=8001, help="port of the engine (default 8001)")
    parser.add_argument(
        "--engine-timeout", type=float, default=900.0,
        help="seconds to wait for the engine to become healthy (first start converts the model)",
    )
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG",
        help="extra argument for 'prefixgate engine' (repeatable), e.g. --engine-arg=--dtype=float32",
    )
    parser.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                        help="the engines keep full KV blocks as files in DIR too (replica i of several "
                        "in DIR/replica-i), so they start warm after a restart (default: off)")
    parser.add_argument("--kv-offload-size", type=float, default=None, metavar="GIB",
                        help="bound on each engine's files in --kv-offload-dir (default: the engine's)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="engines to start on consecutive ports from --engine-port, routed by "
                        "their KV events (default 1; see docs/routing.md)")
    add_routing_options(parser)
    parser.set_defaults(func=run)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _offload_args(args: argparse.Namespace, replica: int) -> list[str]:
    """``prefixgate engine`` flags for replica ``replica``'s disk tier: one directory per engine."""
    if args.kv_offload_dir is None:
        if args.kv_offload_size is not None:
            raise ValueError("--kv-offload-size needs --kv-offload-dir")
        return []
    import os

    path = args.kv_offload_dir if args.replicas == 1 else os.path.join(args.kv_offload_dir, f"replica-{replica}")
    if args.replicas > 1:
        os.makedirs(args.kv_offload_dir, mode=0o700, exist_ok=True)
    size = [] if args.kv_offload_size is None else [f"--kv-offload-size={args.kv_offload_size}"]
    return [f"--kv-offload-dir={path}", *size]


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os
    import secrets
    import signal

    from gateway.config import runtime_dir
    from gateway.config.replica_spec import local_replicas
    from gateway.server.engine_process import EngineProcess, EngineStartError
    from gateway.server.launcher import build_settings, fail, run_gateway
    from gateway.server.ports import ensure_free
    from gateway.stats.metrics import METRICS_HOST

    runtime_dir.clean_stale()  # what a run killed with SIGKILL left behind
    events_dir = runtime_dir.create("kv-events")  # 0700: events name tokens
    try:
        api_key = secrets.token_urlsafe(32)
        # Both ports before anything starts: a port taken by another engine would
        # otherwise answer our health check, and the gateway would die later.
        replicas = local_replicas(args.replicas, args.engine_port, events_dir)
        engines = [EngineProcess(args.engine_port + i, [*args.engine_arg, *extra, *_offload_args(args, i)],
                                 api_key=api_key)
                   for i, (extra, _) in enumerate(replicas)]
        if args.port in range(args.engine_port, args.engine_port + len(engines)):
            raise ValueError(f"--port {args.port} is one of the engines' ports: give them different ports")
        ensure_free(args.host, args.port, "gateway")
        if args.metrics_port is not None:
            ensure_free(METRICS_HOST, args.metrics_port, "metrics")
        for engine in engines:
            ensure_free(engine.host, engine.port, "engine")
        # The engines get one random per-run key; only the gateway holds it (engine_process.py).
        settings = dataclasses.replace(build_settings(args, engines[0].url, [spec for _, spec in replicas]),
                                       upstream_api_key=api_key)
    except ValueError as exc:
        runtime_dir.remove(events_dir)
        return fail(str(exc))
    log = logging.getLogger("prefixgate.serve")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (docker stop) behaves like Ctrl-C: uvicorn shuts down gracefully, re-raises
    # the signal, and the KeyboardInterrupt lands here so the engine is stopped too.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    for engine in engines:
        log.info("starting the engine: %s", " ".join(engine.command))
    engine_died: list[str] = []

    def on_give_up(reason: str) -> None:
        # An engine that keeps failing: stop rather than answer 503 in front of it forever.
        engine_died.append(reason)
        log.error("%s; stopping the gateway", reason)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down gracefully (stats flushed)

    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(args.engine_timeout)
            engine.supervise(on_give_up, args.engine_timeout)  # restarts it if it exits
        log.info("engine healthy at %s; starting the gateway on %s:%d",
                 ", ".join(engine.url for engine in engines), args.host, args.port)
        run_gateway(settings, args.host, args.port, args.log_level)
        return 1 if engine_died else 0
    except EngineStartError as exc:
        print(f"prefixgate serve: {exc}", flush=True)
        return 1
    except KeyboardInterrupt:
        return 1 if engine_died else 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # no interrupt in the middle of stopping
        for engine in engines:
            code = engine.stop()
            log.info("engine stopped (exit status %s)", code)
        runtime_dir.remove(events_dir)
