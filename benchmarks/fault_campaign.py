"""Fault campaign: the gateway and the engine tried as an attacker and a careless client would.

Real processes on loopback: ``prefixgate engine`` (the bundled model, with a per-run
API key as ``prefixgate serve`` gives it), a fault-injecting proxy (in this
process) and ``prefixgate gateway`` in front of it with two isolated tenants.

Phases, each a row of the table:

1. malformed requests (seeded, ``tests/engine/server/bad_requests.py``) to the engine
   and to the gateway: answers >= 500, answers without OpenAI's error shape;
2. valid requests through the gateway with ``--fault-rate`` injected upstream faults
   (500, 503, invalid JSON, a malformed SSE event, an error event, a stream cut short):
   a 5xx exactly for the faulted ones, one stats row per request, 502/503 rows for
   faulted streams;
3. cancellation bursts: streams closed by the client after their first event: 499 rows,
   0 KV blocks in use afterwards;
4. isolation: tenant B's cached tokens on tenant A's prompt (0 expected);
5. the engine's port without the key: 401 on every inference route;
6. oversized: rounds of two 7.5 MiB user messages refused by the engine and through the gateway,
   and another tenant's one-token latency while it is refused (p99 vs idle p99);
7. signals: SIGINT and SIGTERM to a gateway under load: answered requests without a row;
8. image stall (self-contained: its own one-worker gateway in front of the instant fake
   upstream of ``gateway_overhead.py``): a quiet tenant's sequential latency, idle and
   while another tenant's two clients send 8 KiB bodies of nine distinct 2048x2048 PNGs
   in one conversation (each turn compared with the previous one names 18 images).
9. supervision (its own ``serve --replicas 2``, :func:`case_supervision`): streams in flight
   on an engine that gets SIGSTOP (seconds until they end, and how), requests after it;
   ``kill -9`` of ``serve`` (engines left, ports held, a new ``serve`` on the same ports);
   an engine child that exits 0 (seconds until ``serve`` answers again).

Prints the table and writes JSON to benchmarks/results/fault_campaign.json.
Usage: python benchmarks/fault_campaign.py [--cases 2000] [--fault-requests 2000] [--quick] [--only PHASE]
       python benchmarks/fault_campaign.py --only image_stall   # no engine needed
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engine" / "server"))
sys.path.insert(0, str(ROOT / "tests"))  # bad_requests imports support.sse
from bad_requests import cases, check_answer  # noqa: E402
from servers import free_port, wait_healthy  # noqa: E402  (this directory)

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "SmolLM2-135M-Instruct"
FAULTS = ["500", "503", "invalid_json"]  # any request
STREAM_FAULTS = [*FAULTS, "malformed_event", "error_event", "cut"]  # after the first event of a stream
TENANT_KEYS = {name: f"campaign-key-{name}" for name in ("alpha", "beta", "faults", "cancel")}


# --------------------------------------------------------------------------- fault proxy

class FaultProxy:
    """Forwards to the engine; a request whose user text carries ``req-N`` gets the fault
    :func:`fault_for` (seed, N) decides, the same decision the load generator makes."""

    def __init__(self, engine_url: str, key: str, seed: int, rate: float) -> None:
        self.engine_url = engine_url
        self.key = key
        self.seed = seed
        self.rate = rate
        self.enabled = False
        self.client = httpx.AsyncClient(timeout=300)

    def fault_for(self, number: int, stream: bool) -> str | None:
        rng = random.Random(f"fault:{self.seed}:{number}")
        return rng.choice(STREAM_FAULTS if stream else FAULTS) if self.enabled and rng.random() < self.rate else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        fault = None
        stream = b'"stream": true' in body or b'"stream":true' in body
        marker = body.find(b"req-")
        if marker >= 0:
            digits = body[marker + 4: marker + 14].split(b" ")[0].split(b'"')[0]
            fault = self.fault_for(int(digits), stream) if digits.isdigit() else None
        if fault in ("500", "503"):
            await _respond(send, int(fault), b'{"error": {"message": "injected", "type": "server_error"}}')
            return
        if fault == "invalid_json" and not stream:
            await _respond(send, 200, b'{"choices": [ not json')
            return
        headers = {"content-type": "application/json", "authorization": f"Bearer {self.key}"}
        method, path = scope["method"], scope["path"]
        request = self.client.build_request(method, self.engine_url + path, content=body or None, headers=headers)
        upstream = await self.client.send(request, stream=True)
        # Like any proxy, pass the client going away on: closing the upstream cancels it.
        relay = asyncio.ensure_future(self._relay(upstream, send, fault, stream))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
            await upstream.aclose()

    async def _relay(self, upstream: httpx.Response, send: Any, fault: str | None, stream: bool) -> None:
        await send({"type": "http.response.start", "status": upstream.status_code,
                    "headers": [(k.encode(), v.encode()) for k, v in upstream.headers.items()
                                if k.lower() in ("content-type",)]})
        sent_events = 0
        async for chunk in upstream.aiter_raw():
            if fault and stream and sent_events >= 1:
                tail = {"malformed_event": b"data: {oops\n\n", "invalid_json": b"data: [1, 2\n\n",
                        "error_event": b'data: {"error": {"message": "injected mid-stream"}}\n\n',
                        "cut": b""}[fault]
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent_events += chunk.count(b"\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def serve_in_thread(app: Any) -> tuple[str, uvicorn.Server]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


# --------------------------------------------------------------------------- processes

class Processes:
    def __init__(self, workdir: Path, max_model_len: int) -> None:
        self.workdir = workdir
        self.max_model_len = max_model_len
        self.engine_key = secrets.token_urlsafe(32)
        self.children: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def engine(self) -> str:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--port", str(port), "--log-level", "warning",
             "--max-model-len", str(self.max_model_len)],
            env={**self.env, "PREFIXGATE_ENGINE_API_KEY": self.engine_key})
        self.children.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        return url

    def gateway(self, upstream: str, name: str, *extra: str) -> tuple[str, subprocess.Popen[bytes], Path]:
        from gateway.policy.api_key import hash_key

        data = self.workdir / name
        data.mkdir()
        config = data / "gateway.toml"
        config.write_text("".join(f'[tenants.{tenant}]\nkeys = ["{hash_key(key)}"]\n'
                                  for tenant, key in TENANT_KEYS.items()))
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--upstream", upstream, "--port", str(port),
             "--config", str(config), "--data-dir", str(data), "--log-level", "error", *extra],
            env={**self.env, "PREFIXGATE_UPSTREAM_API_KEY": self.engine_key})
        self.children.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        return url, process, data / "prefixgate.db"

    def stop(self) -> None:
        for process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.children:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def db_rows(path: Path, tenant: str | None = None) -> list[tuple[int, str | None]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        if tenant is None:
            return list(connection.execute("SELECT status, error_code FROM request_log"))
        return list(connection.execute("SELECT status, error_code FROM request_log WHERE tenant = ?", (tenant,)))


def engine_blocks_used(engine: str, key: str) -> float:
    text = httpx.get(engine + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prefixgate_engine_kv_blocks_used"))


def chat(number: int, *, stream: bool, max_tokens: int = 2, content: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": content or f"req-{number} say hi"}]}
    if stream:
        body["stream"] = True
    return body


# --------------------------------------------------------------------------- phases

async def post_all(url: str, requests: list[tuple[str, bytes]], key: str, concurrency: int = 8
                   ) -> list[tuple[int, bytes]]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(path: str, body: bytes) -> tuple[int, bytes]:
            async with semaphore:
                response = await client.post(path, content=body, headers={
                    "authorization": f"Bearer {key}", "content-type": "application/json"})
                return response.status_code, response.content

        return await asyncio.gather(*(one(path, body) for path, body in requests))


def phase_malformed(engine: str, gateway: str, engine_key: str, count: int, seed: int) -> dict[str, Any]:
    all_cases = list(cases(seed, count, MODEL))
    requests = [(case.path, case.body) for case in all_cases]
    out: dict[str, Any] = {"cases": count, "seed": seed}
    for name, url, key in (("engine", engine, engine_key), ("gateway", gateway, TENANT_KEYS["alpha"])):
        started = time.perf_counter()
        answers = asyncio.run(post_all(url, requests, key))
        print(f"    {name}: {count} cases in {time.perf_counter() - started:.0f} s", flush=True)
        problems = [(case, check_answer(status, content)) for case, (status, content) in zip(all_cases, answers, strict=True)]
        bad = [(case, problem) for case, problem in problems if problem is not None]
        out[name] = {
            "statuses": dict(Counter(status for status, _ in answers)),
            "5xx": sum(status >= 500 for status, _ in answers),
            "bad_answers": len(bad),
            "examples": [f"{case.kind}: {problem}" for case, problem in bad[:5]],
        }
    return out


def phase_faults(gateway: str, proxy: FaultProxy, db: Path, count: int) -> dict[str, Any]:
    proxy.enabled = True
    numbers = list(range(100_000, 100_000 + count))
    requests = [("/v1/chat/completions", json.dumps(chat(n, stream=n % 2 == 0)).encode()) for n in numbers]
    answers = asyncio.run(post_all(gateway, requests, TENANT_KEYS["faults"]))
    wrong: list[str] = []
    faulted = 0
    for number, (status, content) in zip(numbers, answers, strict=True):
        fault = proxy.fault_for(number, number % 2 == 0)  # the proxy's decision (still enabled here)
        failed = status >= 500 or (status == 200 and b'"error"' in content)
        if fault is None and (status != 200 or failed or check_answer(status, content)):
            wrong.append(f"req-{number} unfaulted: {status} {content[:120]!r}")
        if fault is not None:
            faulted += 1
            if not failed:
                wrong.append(f"req-{number} {fault} not reported: {status} {content[:120]!r}")
            if status >= 500 and check_answer(400, content) is not None:  # the 5xx body is OpenAI-shaped
                wrong.append(f"req-{number} {fault}: error body not OpenAI-shaped")
    proxy.enabled = False
    deadline = time.monotonic() + 30
    while len(db_rows(db, "faults")) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    rows = db_rows(db, "faults")
    return {"requests": count, "faulted": faulted, "wrong": len(wrong), "examples": wrong[:5],
            "rows": len(rows), "rows_5xx": sum(status >= 500 for status, _ in rows)}


async def _cancel_one(client: httpx.AsyncClient, number: int) -> bool:
    body = chat(number, stream=True, max_tokens=64, content=f"req-{number} Write a long story about a bicycle.")
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {TENANT_KEYS['cancel']}"}) as response:
        async for _ in response.aiter_bytes():
            return True  # close after the first bytes
    return False


def phase_cancel(gateway: str, engine: str, engine_key: str, db: Path, bursts: int, size: int) -> dict[str, Any]:

    async def run() -> int:
        started = 0
        async with httpx.AsyncClient(base_url=gateway, timeout=600) as client:
            for burst in range(bursts):
                results = await asyncio.gather(*(_cancel_one(client, 200_000 + burst * size + i) for i in range(size)))
                started += sum(results)
        return started

    started = asyncio.run(run())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (engine_blocks_used(engine, engine_key) > 0
                                           or len(db_rows(db, "cancel")) < bursts * size):
        time.sleep(0.2)
    rows = db_rows(db, "cancel")
    return {"cancelled": bursts * size, "started": started, "rows": len(rows),
            "rows_499": sum(status == 499 for status, _ in rows),
            "blocks_in_use_after": engine_blocks_used(engine, engine_key)}


def phase_isolation(gateway: str) -> dict[str, Any]:
    prompt = "You are the help desk of the Riverbend municipal library. " * 40
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "Opening hours?"}]}

    def cached(tenant: str) -> int:
        response = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=300,
                              headers={"authorization": f"Bearer {TENANT_KEYS[tenant]}"})
        response.raise_for_status()
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    first, second = cached("alpha"), cached("alpha")
    other = cached("beta")
    return {"alpha_first": first, "alpha_second": second, "beta_on_alpha_prompt": other}


def phase_engine_auth(engine: str) -> dict[str, Any]:
    statuses = {}
    for headers in ({}, {"authorization": "Bearer guess"}):
        for path, body in (("/v1/chat/completions", chat(1, stream=False)), ("/v1/completions",
                                                                             {"model": MODEL, "prompt": "hi"})):
            response = httpx.post(engine + path, json=body, headers=headers, timeout=60)
            statuses[f"{path} {'no key' if not headers else 'wrong key'}"] = response.status_code
    return {"statuses": statuses, "answered": sum(status < 400 for status in statuses.values())}


def phase_oversized(engine: str, gateway: str, engine_key: str, quiet: int, rounds: int = 10) -> dict[str, Any]:
    """``rounds`` times two 7.5 MiB messages at once (a second apart), while another tenant
    sends one-token requests back to back; its latency over the requests that overlapped
    a round is compared with ``quiet`` requests made before, on an idle server."""
    big = json.dumps(chat(0, stream=False, content="x" * (7 * 1024 * 1024 + 512 * 1024))).encode()
    return {
        "engine": _oversized_side(engine, engine_key, engine_key, big, quiet, rounds),
        "gateway": _oversized_side(gateway, TENANT_KEYS["alpha"], TENANT_KEYS["beta"], big, quiet, rounds),
    }


def _oversized_side(url: str, key: str, other_key: str, big: bytes, quiet: int, rounds: int) -> dict[str, Any]:
    small_body = chat(1, stream=False, max_tokens=1)
    refusals: list[tuple[int, float]] = []
    windows: list[tuple[float, float]] = []

    def refuse() -> None:
        with httpx.Client(timeout=600) as sender:
            start = time.perf_counter()
            response = sender.post(url + "/v1/chat/completions", content=big, headers={
                "authorization": f"Bearer {key}", "content-type": "application/json"})
            refusals.append((response.status_code, time.perf_counter() - start))

    def send_rounds() -> None:
        for _ in range(rounds):
            start = time.perf_counter()
            pair = [threading.Thread(target=refuse) for _ in range(2)]
            for thread in pair:
                thread.start()
            for thread in pair:
                thread.join()
            windows.append((start, time.perf_counter()))
            time.sleep(1.0)

    with httpx.Client(timeout=600) as client:
        def small() -> tuple[float, float]:
            start = time.perf_counter()
            client.post(url + "/v1/chat/completions", json=small_body,
                        headers={"authorization": f"Bearer {other_key}"}).raise_for_status()
            return start, time.perf_counter()

        idle = [end - start for start, end in (small() for _ in range(quiet))]
        rounds_thread = threading.Thread(target=send_rounds)
        rounds_thread.start()
        timed: list[tuple[float, float]] = []
        while rounds_thread.is_alive():
            timed.append(small())
        rounds_thread.join()
    during = [end - start for start, end in timed
              if any(start < w_end and end > w_start for w_start, w_end in windows)]
    return {
        "refusal_statuses": [status for status, _ in refusals],
        "refusal_s": max(seconds for _, seconds in refusals),
        "refusal_median_s": sorted(seconds for _, seconds in refusals)[len(refusals) // 2],
        "other_idle_p99_ms": 1000 * _p99(idle),
        "other_during_p99_ms": 1000 * _p99(during),
        "other_during_n": len(during),
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def phase_signal(processes: Processes, upstream: str, sig: signal.Signals, requests: int) -> dict[str, Any]:
    url, process, db = processes.gateway(upstream, f"signal-{sig.name}")
    answered = 0

    async def run() -> int:
        ok = 0
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            semaphore = asyncio.Semaphore(16)

            async def one(number: int) -> None:
                nonlocal ok
                async with semaphore:
                    try:
                        response = await client.post("/v1/chat/completions", json=chat(number, stream=number % 3 == 0),
                                                     headers={"authorization": f"Bearer {TENANT_KEYS['alpha']}"})
                    except httpx.HTTPError:
                        return
                    if response.status_code == 200 and b'"error"' not in response.content:
                        ok += 1
                        if ok == requests // 4:
                            process.send_signal(sig)

            await asyncio.gather(*(one(300_000 + i) for i in range(requests)), return_exceptions=True)
        return ok

    answered = asyncio.run(run())
    code = process.wait(120)
    rows = db_rows(db)
    ok_rows = sum(status == 200 for status, _ in rows)
    return {"answered_200": answered, "rows_200": ok_rows, "rows": len(rows), "exit": code,
            "lost": max(0, answered - ok_rows)}


def distinct_pngs(count: int, side: int = 2048) -> list[bytes]:
    """``count`` PNGs of ``side`` x ``side`` 1-bit zeros that differ in their bytes (a text
    chunk numbers them), so every one is decoded anew; ~600 bytes each for 2048x2048."""
    import io
    import struct
    import zlib

    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (side, side), 0).save(out, format="PNG", optimize=True)
    base = out.getvalue()
    head, tail = base[:33], base[33:]  # signature + IHDR, then the rest

    def chunk(n: int) -> bytes:
        data = b"tEXt" + b"n\0" + str(n).encode()
        return struct.pack(">I", len(data) - 4) + data + struct.pack(">I", zlib.crc32(data))

    return [head + chunk(n) + tail for n in range(count)]


def phase_image_stall(processes: Processes, seconds: float, quiet: int = 200, kind: str = "images") -> dict[str, Any]:
    """A quiet tenant's one-token requests back to back, in idle windows alternating
    with windows (``seconds`` of each in all) while two clients of another tenant send
    nine-image turns of one conversation (``kind`` "text": bodies of the same size
    without images, to compare; "messages": 2 MiB bodies of 40,000 short messages,
    whose parsing and canonicalization grow with the body)."""
    import base64

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gateway_overhead import wait_healthy as wait_upstream

    port = free_port()
    upstream = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gateway_overhead.py"),
                                 "--serve-upstream", str(port)])
    processes.children.append(upstream)
    wait_upstream(f"http://127.0.0.1:{port}", upstream)
    url, _, _ = processes.gateway(f"http://127.0.0.1:{port}", f"stall-{kind}", "--workers", "1")
    pngs = distinct_pngs(2000)
    bodies: list[bytes] = []
    for n in range(0, len(pngs) - 8, 9):
        parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
                 if kind == "images" else {"type": "text", "text": base64.b64encode(png).decode()}
                 for png in pngs[n:n + 9]]
        bodies.append(json.dumps({"model": "fake-model", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Which is darker?"}, *parts]}]}).encode())
    if kind == "messages":
        bodies = [json.dumps({"model": "fake-model", "max_tokens": 1, "messages": [
            {"role": "user", "content": f"note {n}-{i}"} for i in range(40_000)]}).encode() for n in range(4)]
    largest = max(len(body) for body in bodies)
    quiet_body = {"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "Ping?"}]}
    noisy: list[tuple[int, float]] = []
    cut_short: list[bool] = []  # the prefix check did not finish within its budget (GW001)
    stop, active = threading.Event(), threading.Event()
    in_flight = threading.Semaphore(2)  # held by a sender while its request is out

    def send_images(client_number: int) -> None:
        headers = {"authorization": f"Bearer {TENANT_KEYS['alpha']}", "content-type": "application/json",
                   "x-prefixgate-conversation": f"images-{client_number}"}
        with httpx.Client(timeout=120) as sender:
            n = client_number
            while not stop.is_set():
                if not active.wait(0.05):
                    continue
                with in_flight:
                    start = time.perf_counter()
                    response = sender.post(url + "/v1/chat/completions", content=bodies[n % len(bodies)],
                                           headers=headers)
                    noisy.append((response.status_code, time.perf_counter() - start))
                    cut_short.append("GW001" in response.headers.get("x-prefixgate-warnings", ""))
                n += 2

    # Idle and noisy windows alternate (``rounds`` of each), so both see the same
    # background load; an idle window starts once no noisy request is out.
    rounds = max(2, int(seconds))
    window = seconds / rounds
    idle: list[float] = []
    during: list[float] = []
    senders = [threading.Thread(target=send_images, args=(i,)) for i in range(2)]
    with httpx.Client(timeout=120) as client:
        def one() -> float:
            start = time.perf_counter()
            client.post(url + "/v1/chat/completions", json=quiet_body,
                        headers={"authorization": f"Bearer {TENANT_KEYS['beta']}"}).raise_for_status()
            return time.perf_counter() - start

        def measure(into: list[float]) -> None:
            deadline = time.perf_counter() + window
            while time.perf_counter() < deadline:
                into.append(one())

        for _ in range(quiet // 10):
            one()  # warm-up
        for sender in senders:
            sender.start()
        for _ in range(rounds):
            active.clear()
            for _ in range(2):
                in_flight.acquire()  # both senders idle
            for _ in range(2):
                in_flight.release()
            measure(idle)
            active.set()
            measure(during)
        stop.set()
        for sender in senders:
            sender.join()
    return {
        "image_body_bytes": largest, "seconds": seconds,
        "quiet_idle_p50_ms": 1000 * sorted(idle)[len(idle) // 2], "quiet_idle_p99_ms": 1000 * _p99(idle),
        "quiet_during_p50_ms": 1000 * sorted(during)[len(during) // 2], "quiet_during_p99_ms": 1000 * _p99(during),
        "quiet_idle_max_ms": 1000 * max(idle), "quiet_during_max_ms": 1000 * max(during),
        "quiet_idle_answers": len(idle), "quiet_during_answers": len(during),
        "noisy_requests": len(noisy), "noisy_statuses": sorted({status for status, _ in noisy}),
        "noisy_checks_cut_short": sum(cut_short),
        "noisy_p50_ms": 1000 * sorted(seconds for _, seconds in noisy)[len(noisy) // 2] if noisy else None,
    }
# --------------------------------------------------------------------------- supervision

def _serve(data: Path, port: int, engine_port: int, replicas: int) -> subprocess.Popen[bytes]:
    data.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--replicas", str(replicas), "--port", str(port),
         "--engine-port", str(engine_port), "--data-dir", str(data), "--health-interval", "60",
         "--engine-arg=--kv-cache-memory=0.05", "--log-level", "error"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    wait_healthy(f"http://127.0.0.1:{port}", process)
    return process


def _engines_of(serve: subprocess.Popen[bytes]) -> dict[int, int]:
    """Engine port -> pid among the children of ``serve``."""
    found = {}
    for pid in map(int, subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True,
                                       text=True).stdout.split()):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"engine" in args and b"--port" in args:
            found[int(args[args.index(b"--port") + 1])] = pid
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _port_held(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _stream_outcome(url: str, tenant: str, first: threading.Event) -> tuple[str, float]:
    """Stream 100 tokens; ("ok" | the error's code, when it ended)."""
    body = {"model": MODEL, "stream": True, "max_tokens": 100, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Team {tenant}: count from 1 to 500."}]}
    outcome = "no answer"
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600,
                          headers={"authorization": f"Bearer {tenant}"}) as response:
            for line in response.iter_lines():
                first.set()
                if line.startswith("data: {\"error\""):
                    outcome = json.loads(line[6:])["error"]["code"] or "error"
                elif line == "data: [DONE]" and outcome == "no answer":  # a stream's error also ends with [DONE]
                    outcome = "ok"
    except httpx.HTTPError as exc:
        outcome = type(exc).__name__
    finally:
        first.set()
    return outcome, time.monotonic()


def case_supervision(workdir: Path) -> dict[str, Any]:
    """Self-contained: its own ``serve`` processes on fresh ports; the figures of issue 29's
    items 4 and 5."""
    port, engine_port = free_port(), 20000 + free_port() % 20000
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    serve = _serve(workdir / "supervision-1", port, engine_port, 2)
    engines = _engines_of(serve)
    try:
        firsts = [threading.Event() for _ in range(4)]
        results: list[tuple[str, float]] = []
        threads = [threading.Thread(target=lambda i=i: results.append(_stream_outcome(url, f"s{i}", firsts[i])))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for event in firsts:
            event.wait(600)
        os.kill(engines[engine_port + 1], signal.SIGSTOP)
        stopped = time.monotonic()
        for thread in threads:
            thread.join(900)
        out["in_flight"] = sorted((code, round(at - stopped, 1)) for code, at in results)
        after = [httpx.post(url + "/v1/chat/completions", timeout=600, headers={"authorization": f"Bearer a{i}"},
                            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
                            ).status_code for i in range(4)]
        out["after_statuses"] = after
        serve.kill()  # kill -9, one engine still stopped
        serve.wait(60)
        killed = time.monotonic()
        while any(_alive(pid) for pid in engines.values()) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        out["engines_left_after_kill9"] = sum(_alive(pid) for pid in engines.values())
        out["engines_gone_s"] = round(time.monotonic() - killed, 2)
        # the listening sockets close with their processes; a port may stay unbindable for a
        # moment while the kernel finishes closing the connections that were open on it
        ports = (port, engine_port, engine_port + 1)
        while any(_port_held(p) for p in ports) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        out["ports_held_after_kill9"] = [p for p in ports if _port_held(p)]
        out["ports_free_s"] = round(time.monotonic() - killed, 2)
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in engines.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    began = time.monotonic()
    try:
        again = _serve(workdir / "supervision-2", port, engine_port, 1)
    except RuntimeError as exc:
        out["restart_error"] = str(exc)
        return out
    out["new_serve_healthy_s"] = round(time.monotonic() - began, 1)
    try:
        (old,) = _engines_of(again).values()
        os.kill(old, signal.SIGTERM)  # the engine exits 0
        exited = time.monotonic()
        status = None
        while time.monotonic() - exited < 600:
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"authorization": "Bearer b"},
                                    json={"model": MODEL, "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]}).status_code
                if status == 200 and _alive(old) is False:
                    break
            time.sleep(0.2)
        out["after_exit0_status"] = status
        out["after_exit0_answering_s"] = round(time.monotonic() - exited, 1)
    finally:
        again.send_signal(signal.SIGINT)
        out["second_serve_exit"] = again.wait(120)
    return out


def supervision_rows(s: dict[str, Any]) -> list[tuple[str, str, bool]]:
    errors = [at for code, at in s.get("in_flight", []) if code != "ok"]
    return [
        ("SIGSTOPped replica: in-flight streams ended (code, s)", str(s.get("in_flight")),
         bool(errors) and max(errors) < 30),
        ("  requests after it", str(s.get("after_statuses")), s.get("after_statuses") == [200] * 4),
        ("kill -9 of serve: engines left / gone in; ports held / free in", f"{s.get('engines_left_after_kill9')} / "
         f"{s.get('engines_gone_s')} s; {s.get('ports_held_after_kill9')} / {s.get('ports_free_s')} s",
         s.get("engines_left_after_kill9") == 0 and s.get("ports_held_after_kill9") == []),
        ("  a new serve on the same ports: healthy in", f"{s.get('new_serve_healthy_s', s.get('restart_error'))} s",
         "new_serve_healthy_s" in s),
        ("engine child exits 0: serve answers again in", f"{s.get('after_exit0_answering_s')} s "
         f"(status {s.get('after_exit0_status')})", s.get("after_exit0_status") == 200),
    ]


# --------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000, help="malformed requests per server")
    parser.add_argument("--fault-requests", type=int, default=2000, help="requests with injected faults")
    parser.add_argument("--fault-rate", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the engine's context (default 2048: bounds the prefill of the largest valid cases)")
    parser.add_argument("--quick", action="store_true", help="200 cases, 200 fault requests")
    parser.add_argument("--only", default=None, metavar="PHASE",
                        help="run one phase: malformed, faults, cancel, isolation, engine_auth, oversized, signals, "
                        "image_stall, supervision")
    parser.add_argument("--image-seconds", type=float, default=15.0,
                        help="how long the image-stall case's noisy tenant sends (default 15)")
    parser.add_argument("--image-text-too", action="store_true",
                        help="image_stall: also measure a noisy tenant sending text bodies of the same size, "
                        "and one sending 2 MiB bodies of 40,000 messages")
    parser.add_argument("--image-kinds", default=None, metavar="KINDS",
                        help="image_stall: the noisy bodies to measure, comma-separated among images, text, "
                        "messages (default: images; all three with --image-text-too)")
    args = parser.parse_args()
    if args.quick:
        args.cases, args.fault_requests = 200, 200
    results: dict[str, Any] = {"machine": platform.platform(), "python": platform.python_version(),
                               "cpus": os.cpu_count(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="prefixgate-campaign-") as tmp:
        if args.only == "supervision":  # its own serve processes: nothing else is started
            results["supervision"] = case_supervision(Path(tmp))
            results["seconds"] = {}
            return _write_and_print(results)
        processes = Processes(Path(tmp), args.max_model_len)
        if args.only == "image_stall":  # self-contained: no engine
            try:
                kinds = (args.image_kinds.split(",") if args.image_kinds
                         else ["images", "text", "messages"] if args.image_text_too else ["images"])
                for kind in kinds:
                    case = "image_stall" if kind == "images" else f"image_stall_{kind}"
                    results[case] = phase_image_stall(processes, args.image_seconds, kind=kind)
                results["seconds"] = {}
            finally:
                processes.stop()
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / "fault_campaign_image_stall.json").write_text(json.dumps(results, indent=2) + "\n")
            return print_table(results)
        try:
            engine = processes.engine()
            proxy = FaultProxy(engine, processes.engine_key, args.seed, args.fault_rate)
            proxy_url, proxy_server = serve_in_thread(proxy)
            gateway, _, db = processes.gateway(proxy_url, "main")
            timings: dict[str, float] = {}

            def timed(name: str, fn: Any, *fn_args: Any) -> Any:
                start = time.perf_counter()
                print(f"... {name}", flush=True)
                value = fn(*fn_args)
                timings[name] = round(time.perf_counter() - start, 1)
                return value

            phases: dict[str, Any] = {
                "malformed": lambda: timed("malformed", phase_malformed, engine, gateway, processes.engine_key,
                                           args.cases, args.seed),
                "faults": lambda: timed("faults", phase_faults, gateway, proxy, db, args.fault_requests),
                "cancel": lambda: timed("cancel", phase_cancel, gateway, engine, processes.engine_key, db, 4, 16),
                "isolation": lambda: timed("isolation", phase_isolation, gateway),
                "engine_auth": lambda: timed("engine_auth", phase_engine_auth, engine),
                "oversized": lambda: timed("oversized", phase_oversized, engine, gateway, processes.engine_key, 30),
            }
            for name, run in phases.items():
                if args.only in (None, name):
                    results[name] = run()
            if args.only in (None, "signals"):
                for sig in (signal.SIGINT, signal.SIGTERM):
                    results[f"signal_{sig.name}"] = timed(sig.name, phase_signal, processes, proxy_url, sig, 200)
            if args.only is None:
                results["image_stall"] = timed("image_stall", phase_image_stall, processes, args.image_seconds)
                results["supervision"] = timed("supervision", case_supervision, Path(tmp))
            results["blocks_in_use_at_end"] = engine_blocks_used(engine, processes.engine_key)
            results["seconds"] = timings
            proxy_server.should_exit = True
        finally:
            processes.stop()
    return _write_and_print(results)


def _write_and_print(results: dict[str, Any]) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fault_campaign.json").write_text(json.dumps(results, indent=2) + "\n")
    return print_table(results)


def print_table(r: dict[str, Any]) -> int:
    """The table of the phases that ran; exit status 1 when a check failed."""
    rows: list[tuple[str, str, bool]] = []
    if "malformed" in r:
        m = r["malformed"]
        for side in ("engine", "gateway"):
            rows.append((f"malformed -> {side}: 5xx / not OpenAI-shaped",
                         f"{m[side]['5xx']} / {m[side]['bad_answers']} of {m['cases']}", m[side]["bad_answers"] == 0))
    if "faults" in r:
        f = r["faults"]
        rows.append(("faults: wrong answers (5xx iff faulted)", f"{f['wrong']} of {f['requests']} "
                     f"({f['faulted']} faulted)", f["wrong"] == 0))
        rows.append(("faults: rows written / 5xx rows", f"{f['rows']} / {f['rows_5xx']}",
                     f["rows"] == f["requests"] and f["rows_5xx"] == f["faulted"]))
    if "cancel" in r:
        c = r["cancel"]
        rows.append(("cancellation bursts: 499 rows / blocks in use after", f"{c['rows_499']} of {c['cancelled']} / "
                     f"{c['blocks_in_use_after']:.0f}", c["rows_499"] == c["cancelled"] and c["blocks_in_use_after"] == 0))
    if "isolation" in r:
        i = r["isolation"]
        rows.append(("isolation: tenant B cached tokens on A's prompt", f"{i['beta_on_alpha_prompt']} "
                     f"(A's repeat: {i['alpha_second']})", i["beta_on_alpha_prompt"] == 0 and i["alpha_second"] > 0))
    if "engine_auth" in r:
        a = r["engine_auth"]
        rows.append(("engine port without the key: requests answered", f"{a['answered']} of {len(a['statuses'])}",
                     a["answered"] == 0))
    for name, side in r.get("oversized", {}).items():
        rows.append((f"7.5 MiB message -> {name}: statuses, refusal median / max",
                     f"{sorted(set(side['refusal_statuses']))} x{len(side['refusal_statuses'])}, "
                     f"{side['refusal_median_s']:.2f} / {side['refusal_s']:.2f} s",
                     all(400 <= status < 500 for status in side["refusal_statuses"])))
        rows.append((f"  other tenant p99 via {name}: idle / during (ms)",
                     f"{side['other_idle_p99_ms']:.0f} / {side['other_during_p99_ms']:.0f} (n={side['other_during_n']})",
                     side["other_during_p99_ms"] <= 2 * side["other_idle_p99_ms"]))
    for sig in ("SIGINT", "SIGTERM"):
        if f"signal_{sig}" in r:
            s = r[f"signal_{sig}"]
            rows.append((f"{sig} under load: answered rows lost", f"{s['lost']} of {s['answered_200']} "
                         f"(exit {s['exit']})", s["lost"] == 0))
    for case, what in (("image_stall", "9x2048x2048 images"), ("image_stall_text", "text instead"),
                       ("image_stall_messages", "40k messages")):
        if case not in r:
            continue
        i = r[case]
        rows.append((f"{what} in {i['image_body_bytes']} B: quiet p50 idle / during (ms)",
                     f"{i['quiet_idle_p50_ms']:.1f} / {i['quiet_during_p50_ms']:.1f} "
                     f"(answers {i['quiet_idle_answers']} / {i['quiet_during_answers']} in {i['seconds']:g} s each)",
                     True))
        rows.append(("  quiet tenant p99 idle / during (ms), noisy answers",
                     f"{i['quiet_idle_p99_ms']:.1f} / {i['quiet_during_p99_ms']:.1f}, "
                     f"{i['noisy_requests']} x{i['noisy_statuses']}",
                     i["quiet_during_p99_ms"] <= 2 * i["quiet_idle_p99_ms"] and i["noisy_statuses"] == [200]))
        if "quiet_during_max_ms" in i:  # the longest single answer: the worst event-loop stall it met
            rows.append(("  quiet tenant max idle / during (ms)",
                         f"{i['quiet_idle_max_ms']:.1f} / {i['quiet_during_max_ms']:.1f}", True))
    if "supervision" in r:
        rows.extend(supervision_rows(r["supervision"]))
    if "blocks_in_use_at_end" in r:
        rows.append(("KV blocks in use at the end", f"{r['blocks_in_use_at_end']:.0f}",
                     r["blocks_in_use_at_end"] == 0))
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'check':<{width}}  {'result':<40}  ok")
    print("-" * (width + 48))
    for name, value, ok in rows:
        print(f"{name:<{width}}  {value:<40}  {'yes' if ok else 'NO'}")
    for side in ("engine", "gateway"):
        for example in r.get("malformed", {}).get(side, {}).get("examples", []):
            print(f"  {side}: {example[:200]}")
    for example in r.get("faults", {}).get("examples", []):
        print(f"  faults: {example[:200]}")
    print(f"\nseconds per phase: {r['seconds']}; JSON in benchmarks/results/fault_campaign.json")
    return 0 if all(ok for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
