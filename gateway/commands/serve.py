"""``prefixgate serve``: the bundled engine as a child process with the gateway in front."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.launcher import add_common_options
from gateway.replica_spec import add_routing_options

EPILOG = """examples:
  prefixgate serve --port 8000 --engine-port 8001
  prefixgate serve --replicas 3 --engine-arg=--kv-cache-memory=0.05   # engines on 8001-8003
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
    parser.add_argument("--replicas", type=int, default=1,
                        help="engines to start on consecutive ports from --engine-port, routed by "
                        "their KV events (default 1; see docs/routing.md)")
    add_routing_options(parser)
    parser.set_defaults(func=run)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os
    import secrets
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from gateway.engine_process import EngineProcess, EngineStartError
    from gateway.launcher import build_settings, fail, run_gateway
    from gateway.ports import ensure_free
    from gateway.replica_spec import local_replicas

    events_dir = Path(tempfile.mkdtemp(prefix="prefixgate-kv-events-"))  # 0700: events name tokens
    try:
        api_key = secrets.token_urlsafe(32)
        # Both ports before anything starts: a port taken by another engine would
        # otherwise answer our health check, and the gateway would die later.
        replicas = local_replicas(args.replicas, args.engine_port, events_dir)
        engines = [EngineProcess(args.engine_port + i, [*args.engine_arg, *extra], api_key=api_key)
                   for i, (extra, _) in enumerate(replicas)]
        if args.port in range(args.engine_port, args.engine_port + len(engines)):
            raise ValueError(f"--port {args.port} is one of the engines' ports: give them different ports")
        ensure_free(args.host, args.port, "gateway")
        for engine in engines:
            ensure_free(engine.host, engine.port, "engine")
        # The engines get one random per-run key; only the gateway holds it (engine_process.py).
        settings = dataclasses.replace(build_settings(args, engines[0].url, [spec for _, spec in replicas]),
                                       upstream_api_key=api_key)
    except ValueError as exc:
        shutil.rmtree(events_dir, ignore_errors=True)
        return fail(str(exc))
    log = logging.getLogger("prefixgate.serve")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (docker stop) behaves like Ctrl-C: uvicorn shuts down gracefully, re-raises
    # the signal, and the KeyboardInterrupt lands here so the engine is stopped too.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    for engine in engines:
        log.info("starting the engine: %s", " ".join(engine.command))
    engine_died: list[int] = []

    def on_engine_exit(status: int) -> None:
        if status == 0:  # a clean exit: the engine got Ctrl-C with us (same process group)
            return
        engine_died.append(status)
        if len(engine_died) < len(engines):  # the gateway routes around a dead replica
            log.error("an engine exited with status %s; %d left", status, len(engines) - len(engine_died))
            return
        log.error("the engine exited with status %s; stopping the gateway", status)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down gracefully (stats flushed)

    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(args.engine_timeout)
            engine.watch(on_engine_exit)
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
        shutil.rmtree(events_dir, ignore_errors=True)
