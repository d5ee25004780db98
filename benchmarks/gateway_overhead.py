"""Latency the gateway adds, and its throughput, against a fast fake upstream.

Three processes on loopback: a fake OpenAI upstream (raw ASGI under uvicorn, a fixed
answer), ``prefixgate gateway`` in front of it (open mode, real stats database,
linter checks and canonicalization on), and this load generator (httpx, keep-alive).

1. Added latency at concurrency 1: direct and via-gateway requests alternate one
   by one in the same run, so both see the same machine noise; p50 and p99 of each
   and of the per-pair difference. Target: added p50 <= 2 ms.
2. Requests per second at concurrency 1, 16 and 128, streaming and not, direct vs
   via the gateway.

Prints a table and writes JSON to benchmarks/results/gateway_overhead.json.
Usage: python benchmarks/gateway_overhead.py [--requests 600] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"

BODY = {
    "model": "fake-model",
    "max_tokens": 16,
    "messages": [
        {"role": "system", "content": "You are the support assistant of a bicycle shop. " * 12},
        {"role": "user", "content": "Where is my order?"},
    ],
    "tools": [
        {"type": "function", "function": {"name": "lookup_order", "description": "Find an order.",
                                          "parameters": {"type": "object",
                                                         "properties": {"order_number": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "book_repair", "description": "Book a repair.",
                                          "parameters": {"type": "object",
                                                         "properties": {"day": {"type": "string"}}}}},
    ],
}


# --------------------------------------------------------------------------- fake upstream

ANSWER = json.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "model": "fake-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "It ships today."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 180, "completion_tokens": 5, "total_tokens": 185,
              "prompt_tokens_details": {"cached_tokens": 176}},
}).encode()


def _chunk(delta: dict[str, Any], finish: str | None) -> bytes:
    chunk = {"id": "cmpl-bench", "object": "chat.completion.chunk", "model": "fake-model",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


USAGE_CHUNK = b"data: " + json.dumps({
    "id": "cmpl-bench", "object": "chat.completion.chunk", "choices": [],
    "usage": {"prompt_tokens": 180, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 176}},
}).encode() + b"\n\n"
STREAM = [_chunk({"role": "assistant", "content": "It "}, None), _chunk({"content": "ships."}, None),
          _chunk({}, "stop")]


async def fake_upstream(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    request = json.loads(body)
    if not request.get("stream"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": ANSWER})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    events = list(STREAM)
    if (request.get("stream_options") or {}).get("include_usage"):
        events.append(USAGE_CHUNK)
    events.append(b"data: [DONE]\n\n")
    for event in events:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# --------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy after {timeout} s")
        time.sleep(0.1)


# --------------------------------------------------------------------------- load

async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    if body.get("stream"):
        async with client.stream("POST", url, json=body) as response:
            async for _ in response.aiter_bytes():
                pass
    else:
        response = await client.post(url, json=body)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
    return elapsed * 1000.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), robust to scheduling noise."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def paired_latency(direct: str, gateway: str, n: int, body: dict[str, Any] = BODY) -> dict[str, Any]:
    limits = httpx.Limits(max_keepalive_connections=4, keepalive_expiry=4.0)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        for _ in range(50):  # warm-up: connections, lazy imports
            await one(client, direct, body)
            await one(client, gateway, body)
        d, g = [], []
        for i in range(n):
            order = (direct, gateway) if i % 2 == 0 else (gateway, direct)
            first, second = await one(client, order[0], body), await one(client, order[1], body)
            (d.append(first), g.append(second)) if order[0] == direct else (g.append(first), d.append(second))
    diffs = [b - a for a, b in zip(d, g, strict=True)]
    return {
        "requests_each": n,
        "direct_p50_ms": pct(d, 50), "direct_p99_ms": pct(d, 99),
        "gateway_p50_ms": pct(g, 50), "gateway_p99_ms": pct(g, 99),
        "added_p50_ms": pct(g, 50) - pct(d, 50), "added_p99_ms": pct(g, 99) - pct(d, 99),
        "paired_added_median_ms": statistics.median(diffs),
    }


async def throughput(url: str, concurrency: int, total: int, stream: bool) -> tuple[float, list[str]]:
    """Successful requests per second, and the errors seen (reported, never hidden)."""
    body = {**BODY, "stream": stream}
    # expire idle connections before uvicorn's 5 s keep-alive timeout closes them under us
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=4.0)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        await asyncio.gather(*(one(client, url, body) for _ in range(concurrency)))  # open connections
        remaining = total
        errors: list[str] = []

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                try:
                    await one(client, url, body)
                except (httpx.HTTPError, RuntimeError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rate = (total - len(errors)) / (time.perf_counter() - started)
        return rate, errors


# --------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600, help="paired requests at concurrency 1")
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream is not None:
        import uvicorn

        uvicorn.run(fake_upstream, host="127.0.0.1", port=args.serve_upstream, log_level="warning",
                    access_log=False)
        return 0
    n = 100 if args.quick else args.requests
    per_level = {1: 100, 16: 400, 128: 1000} if args.quick else {1: 400, 16: 1500, 128: 3000}
    up_port, gw_port = free_port(), free_port()
    direct_base, gateway_base = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as data_dir:
        try:
            processes.append(subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up_port)]))
            wait_healthy(direct_base, processes[0])
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "gateway", "--upstream", direct_base, "--port", str(gw_port),
                 "--data-dir", data_dir, "--log-level", "warning"],
                env={**os.environ, "PREFIXGATE_SECRET": "benchmark-secret-0123456789"},
            ))
            wait_healthy(gateway_base, processes[1])
            direct, gateway = direct_base + "/v1/chat/completions", gateway_base + "/v1/chat/completions"
            cpu_before = [cpu_seconds(p.pid) for p in processes]
            latency = asyncio.run(paired_latency(direct, gateway, n))
            cpu_used = [cpu_seconds(p.pid) - before for p, before in zip(processes, cpu_before, strict=True)]
            # the upstream served both the direct and the proxied requests (+ warm-up)
            latency["upstream_cpu_ms_per_request"] = cpu_used[0] * 1000 / (2 * (n + 50))
            latency["gateway_cpu_ms_per_request"] = cpu_used[1] * 1000 / (n + 50)
            stream_latency = asyncio.run(paired_latency(direct, gateway, n, {**BODY, "stream": True}))
            rates = []
            for stream in (False, True):
                for concurrency, total in per_level.items():
                    direct_rps, direct_errors = asyncio.run(throughput(direct, concurrency, total, stream))
                    gateway_rps, gateway_errors = asyncio.run(throughput(gateway, concurrency, total, stream))
                    rates.append({
                        "stream": stream, "concurrency": concurrency, "requests": total,
                        "direct_rps": direct_rps, "gateway_rps": gateway_rps,
                        "direct_errors": len(direct_errors), "gateway_errors": len(gateway_errors),
                        "error_samples": sorted(set(direct_errors + gateway_errors))[:5],
                    })
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(30)
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "load_average_1m": os.getloadavg()[0]},
              "latency_concurrency_1": latency, "latency_concurrency_1_stream": stream_latency,
              "throughput": rates,
              "target_added_p50_ms": 2.0, "meets_target": latency["added_p50_ms"] <= 2.0}
    print_report(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'gateway_overhead.json'}")
    return 0


def print_report(report: dict[str, Any]) -> None:
    lat = report["latency_concurrency_1"]
    stream = report["latency_concurrency_1_stream"]
    print(f"Latency at concurrency 1 ({lat['requests_each']} alternating requests each; whole response)")
    print(f"  {'':10} {'json p50':>9} {'json p99':>9} {'stream p50':>11} {'stream p99':>11}")
    for name in ("direct", "gateway", "added"):
        print(f"  {name:10} {lat[name + '_p50_ms']:9.2f} {lat[name + '_p99_ms']:9.2f}"
              f" {stream[name + '_p50_ms']:11.2f} {stream[name + '_p99_ms']:11.2f}")
    print(f"  json: paired median added {lat['paired_added_median_ms']:.2f} ms; target p50 <= 2 ms: "
          f"{'met' if report['meets_target'] else 'NOT met'}")
    print(f"  CPU per request: gateway {lat['gateway_cpu_ms_per_request']:.2f} ms, "
          f"fake upstream {lat['upstream_cpu_ms_per_request']:.2f} ms")
    print("\nThroughput (requests/s)")
    print(f"  {'mode':10} {'conc.':>5} {'direct':>9} {'gateway':>9} {'ratio':>6} {'errors d/g':>11}")
    for row in report["throughput"]:
        mode = "stream" if row["stream"] else "json"
        ratio = row["gateway_rps"] / row["direct_rps"]
        errors = f"{row['direct_errors']}/{row['gateway_errors']}"
        print(f"  {mode:10} {row['concurrency']:5d} {row['direct_rps']:9.0f} {row['gateway_rps']:9.0f} {ratio:6.2f}"
              f" {errors:>11}")
    samples = sorted({s for row in report["throughput"] for s in row["error_samples"]})
    for sample in samples[:5]:
        print(f"  error sample: {sample}")


if __name__ == "__main__":
    sys.exit(main())
