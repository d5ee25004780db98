"""Gateway memory around bursts of large bodies that the upstream refuses, and around stalled uploads.

Real processes on loopback: ``prefixgate gateway --workers 1`` (its own config: two tenants,
``upstream_timeout_s`` short enough for the timeout case) in front of a small fault-injecting
upstream served from this process, which reads each body and answers as the case says
(429, 500, 200, or nothing until the gateway's timeout). The gateway's RSS is read from
``/proc/PID/status`` before, at the peak, and ten seconds after each case (issue #28 item 4):

- ``seq429`` / ``seq500`` / ``seq200`` / ``seq_timeout``: N sequential requests of 7.9 MiB;
- ``burst429`` / ``burst500`` / ``burst_timeout``: 8 clients sending such requests at once;
- ``stalled``: C connections that each send 7.9 MB of a declared 8 MB body and stop,
  then close (the gateway's body budget refuses most at once, 429; its idle read
  timeout ends the others, 408).

Targets: RSS <= 600 MiB ten seconds after 40 requests answered 429; within 1.5x of the
idle RSS ten seconds after the concurrent burst and the stalled uploads.
Prints the table and writes JSON to benchmarks/results/gateway_memory.json.
Usage: python benchmarks/gateway_memory.py [--requests 40] [--stalled 100] [--settle 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from servers import free_port, wait_healthy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BODY_BYTES = int(7.9 * 1024 * 1024)
KEYS = {"alpha": "memory-key-alpha", "beta": "memory-key-beta"}
UPSTREAM_TIMEOUT_S = 2.0
MIB = 1024 * 1024


class FaultUpstream:
    """An OpenAI-shaped upstream that reads the whole body, then answers as ``mode`` says."""

    def __init__(self) -> None:
        self.mode = "429"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False) and message["type"] == "http.request"
        if scope["path"] == "/health":
            await _respond(send, 200, b'{"status": "ok"}')
        elif self.mode == "timeout":
            await asyncio.sleep(UPSTREAM_TIMEOUT_S * 3)
            await _respond(send, 200, b"{}")
        elif self.mode == "200":
            await _respond(send, 200, json.dumps({
                "id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {
                    "role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode())
        else:
            status = int(self.mode)
            await _respond(send, status, json.dumps({"error": {
                "message": f"injected {status}", "type": "rate_limit_error" if status == 429 else "server_error",
                "param": None, "code": None}}).encode())


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def serve_in_thread(app: Any) -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Sampler:
    """The peak RSS of ``pid`` while it runs, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.pid))


def big_body() -> bytes:
    filler = "x" * (BODY_BYTES - 200)
    return json.dumps({"model": "m", "max_tokens": 1,
                       "messages": [{"role": "user", "content": filler}]}).encode()


async def send_all(url: str, count: int, concurrency: int) -> dict[int, int]:
    body = big_body()
    statuses: dict[int, int] = {}
    queue = list(range(count))
    async with httpx.AsyncClient(timeout=60) as client:
        async def worker(index: int) -> None:
            key = KEYS["alpha" if index % 2 == 0 else "beta"]
            while queue:
                queue.pop()
                try:
                    response = await client.post(url + "/v1/chat/completions", content=body, headers={
                        "authorization": f"Bearer {key}", "content-type": "application/json"})
                    status = response.status_code
                except httpx.HTTPError:
                    status = 0
                statuses[status] = statuses.get(status, 0) + 1
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return statuses


async def stall(url: str, count: int) -> dict[int, int]:
    """``count`` connections each send 7.9 MB of a declared 8 MB body and stop; what each got."""
    host, port = url.removeprefix("http://").split(":")
    declared = 8_000_000
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {KEYS['alpha']}\r\ncontent-length: {declared}\r\n\r\n").encode()
    part = b"{" + b" " * (7_900_000 - 1)
    statuses: dict[int, int] = {}

    async def one() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head)
            writer.write(part)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 60)
            status = int(line.split()[1]) if line else 0
        except (OSError, TimeoutError, IndexError, ValueError):
            status = 0
        finally:
            writer.close()
        statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(one() for _ in range(count)))
    return statuses


def write_config(workdir: Path, upstream: str) -> Path:
    from gateway.policy.api_key import hash_key

    lines = ["[server]", f'upstream = "{upstream}"', f"upstream_timeout_s = {UPSTREAM_TIMEOUT_S}", ""]
    for name, key in KEYS.items():
        lines += [f"[tenants.{name}]", f'keys = ["{hash_key(key)}"]', "warnings = false", ""]
    path = workdir / "gateway.toml"
    path.write_text("\n".join(lines))
    return path


def run_case(name: str, pid: int, settle: float, action: Any) -> dict[str, Any]:
    before = rss_mib(pid)
    started = time.perf_counter()
    with Sampler(pid) as sampler:
        statuses = action()
    elapsed = time.perf_counter() - started
    time.sleep(settle)
    after = rss_mib(pid)
    row = {"case": name, "before_mib": round(before, 1), "peak_mib": round(max(sampler.peak, before), 1),
           "after_mib": round(after, 1), "statuses": statuses, "seconds": round(elapsed, 2)}
    print(f"  {name:13} before {before:7.1f}  peak {row['peak_mib']:7.1f}  after {after:7.1f} MiB  "
          f"{statuses}  {elapsed:.1f} s", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stalled", type=int, default=100)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between a case and its 'after'")
    args = parser.parse_args()
    upstream = FaultUpstream()
    upstream_url = serve_in_thread(upstream)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="pg-memory-") as tmp:
        workdir = Path(tmp)
        config = write_config(workdir, upstream_url)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-m", "gateway.cli", "gateway", "--workers", "1", "--config", str(config),
                "--data-dir", str(workdir), "--port", str(port), "--log-level", "error"]
        proc = subprocess.Popen(argv, cwd=ROOT, env=env)
        try:
            wait_healthy(url, proc, timeout=60)
            time.sleep(1.0)
            idle = rss_mib(proc.pid)
            print(f"gateway pid {proc.pid}, idle RSS {idle:.1f} MiB", flush=True)
            rows = []
            for name, mode, concurrency in [("seq429", "429", 1), ("seq500", "500", 1),
                                            ("seq_timeout", "timeout", 1), ("seq200", "200", 1),
                                            ("burst429", "429", args.concurrency),
                                            ("burst500", "500", args.concurrency),
                                            ("burst_timeout", "timeout", args.concurrency)]:
                upstream.mode = mode
                count = args.requests if mode != "timeout" else max(concurrency, args.requests // 4)
                rows.append(run_case(name, proc.pid, args.settle,
                                     lambda c=count, n=concurrency: asyncio.run(send_all(url, c, n))))
            rows.append(run_case("stalled", proc.pid, args.settle, lambda: asyncio.run(stall(url, args.stalled))))
        finally:
            proc.terminate()
            proc.wait(30)
    seq429 = next(row for row in rows if row["case"] == "seq429")
    worst = max(row["after_mib"] for row in rows if row["case"].startswith("burst") or row["case"] == "stalled")
    verdict = {"idle_mib": round(idle, 1), "seq429_after_mib": seq429["after_mib"],
               "seq429_ok": seq429["after_mib"] <= 600, "worst_after_ratio": round(worst / idle, 2),
               "ratio_ok": worst <= 1.5 * idle}
    print(json.dumps(verdict))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gateway_memory.json").write_text(json.dumps(
        {"args": vars(args), "body_bytes": BODY_BYTES, "rows": rows, "verdict": verdict}, indent=2))
    return 0 if verdict["seq429_ok"] and verdict["ratio_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
