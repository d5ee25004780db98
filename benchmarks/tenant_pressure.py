"""One tenant's heavy work against another's short requests, on one ``prefixgate engine``.

Two cases (issue 29, items 2 and 3), each against a real engine process on loopback:

* ``prefill``: an engine (behind an API key) and, by default, a ``prefixgate
  gateway`` in front of it with two tenants, ``quiet`` and ``heavy``, each its own
  API key (the gateway names them to the engine in ``x-prefixgate-tenant``;
  ``--via engine`` sends straight to the engine with that header instead). First one
  cold prompt of ``--heavy-tokens`` distinct tokens (8k by default) alone, timed (a
  lone long prompt's throughput; it caches the heavy tenant's prefix). Then
  ``--rounds`` rounds, each an idle window then a loaded window of
  ``--quiet-per-window`` quiet requests (a one-token chat, sequential, each timed
  to its whole answer of ``max_tokens: 1``: its TTFT): idle, the engine has no
  other request; loaded, the heavy tenant keeps ``--heavy-streams`` prompts in
  flight, each that prompt's cached first ``heavy_tokens - heavy_new_tokens``
  tokens and ``--heavy-new-tokens`` new ones, so the engine keeps computing at
  7.7-8k context (a cold 8k prompt spends most of its time at short context). The
  windows alternate so that both phases see the same background load; a loaded
  window starts once a heavy prompt is admitted, an idle one once the engine has
  no request (its metrics). Target (issue 29): the quiet tenant's loaded p99 within
  2x its idle p99. With ``--before-root`` the same on another checkout (engine and
  gateway) first: a before/after in one run.
* ``images``: a tiny random LLaVA (``tests/engine/multimodal/tiny_vlm.py``) served
  with ``--max-image-pixels-in-flight``; ``--image-requests`` requests at once, each
  with 8 distinct 6320x6320 PNGs of zeros (one pixel differs), while a quiet tenant
  keeps sending text requests. The engine's RSS (``/proc/PID/status``) idle, peak
  and 3 s after the last answer; the image requests' statuses; the quiet tenant's
  latency p50/p99 meanwhile.

Prints a table and writes benchmarks/results/tenant_pressure.json. The load average
is printed with each round: on a shared machine compare within one run, and prefer
``--threads 1`` (torch's busy-waiting threads slow many times over when other
processes hold the cores).
Usage: python benchmarks/tenant_pressure.py [--only prefill|images] [--via gateway|engine]
       [--rounds 4 --quiet-per-window 25] [--threads 1] [--before-root ../checkout-before]
       [--max-image-pixels 0 --engine-root ../other-checkout]   (the images case on an older engine)
Example: python benchmarks/tenant_pressure.py --only prefill   (about 2-5 minutes on a quiet 2-core machine)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import os
import platform
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "engine" / "multimodal"))
from servers import free_port, wait_healthy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "tenant_pressure.json"
TENANT_HEADER = "x-prefixgate-tenant"
IMAGE_SIDE = 6320
TENANTS = ("quiet", "heavy")


@contextlib.contextmanager
def engine(*flags: str, log: Path, root: Path = ROOT, key: str | None = None) -> Iterator[tuple[str, int]]:
    """``prefixgate engine`` of the checkout ``root`` with ``flags`` (behind ``key`` when
    given); yields (base URL, pid)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PREFIXGATE_ENGINE_API_KEY", None)
    if key is not None:
        env["PREFIXGATE_ENGINE_API_KEY"] = key
    argv = [sys.executable, "-m", "gateway.cli", "engine", "--port", str(port), "--log-level", "warning", *flags]
    with _process(argv, log, root, env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        yield url, proc.pid


@contextlib.contextmanager
def gateway(upstream: str, upstream_key: str, tenant_keys: dict[str, str], data: Path, log: Path,
            root: Path = ROOT) -> Iterator[str]:
    """``prefixgate gateway`` of the checkout ``root`` in front of the engine ``upstream``
    (its key ``upstream_key``), one tenant per entry of ``tenant_keys`` (name -> API key);
    yields its base URL."""
    from gateway.policy.api_key import hash_key

    data.mkdir(parents=True, exist_ok=True)
    config = data / "gateway.toml"
    config.write_text("".join(f'[tenants.{name}]\nkeys = ["{hash_key(key)}"]\n' for name, key in tenant_keys.items()))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "PREFIXGATE_UPSTREAM_API_KEY": upstream_key}
    argv = [sys.executable, "-m", "gateway.cli", "gateway", "--upstream", upstream, "--port", str(port),
            "--config", str(config), "--data-dir", str(data), "--log-level", "warning"]
    with _process(argv, log, root, env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        yield url


@contextlib.contextmanager
def _process(argv: list[str], log: Path, root: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A process group logging to ``log``, stopped (SIGTERM, then SIGKILL) on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50_ms": statistics.median(ordered) * 1000, "p99_ms": p99 * 1000}


async def quiet_requests(client: httpx.AsyncClient, count: int, stop: asyncio.Event | None = None,
                         model: str | None = None, computed: list[int] | None = None) -> list[float]:
    """Up to ``count`` one-token chats in sequence on ``client`` (its base URL and the
    quiet tenant's headers), each timed to its whole answer; stops early at ``stop``.
    Appends to ``computed`` the prompt tokens each answer's usage says were not cached."""
    out: list[float] = []
    for i in range(count):
        if stop is not None and stop.is_set():
            break
        body: dict[str, Any] = {"max_tokens": 1, "temperature": 0,
                                "messages": [{"role": "user", "content": f"Quiet question number {i}: say hi"}]}
        if model is not None:
            body["model"] = model
        start = time.perf_counter()
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            out.append(time.perf_counter() - start)
            if computed is not None:
                usage = response.json()["usage"]
                computed.append(usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0))
    return out


async def warm_up(url: str, headers: dict[str, str], model: str | None = None) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        await quiet_requests(client, 3, model=model)


# --------------------------------------------------------------------------- prefill

@dataclass
class Target:
    """Where the tenants send: ``url`` with each tenant's ``headers`` (an API key through
    the gateway, the tenant header straight to the engine), and the engine itself."""

    url: str
    headers: dict[str, dict[str, str]]
    engine_url: str
    engine_key: str
    model: str

    poller: httpx.Client
    """For the engine's metrics, made once: each new httpx client costs ~20 ms of CPU
    (its TLS context), which polling every 50 ms would take from the engine measured."""

    def engine_gauge(self, name: str) -> float:
        text = self.poller.get(self.engine_url + "/metrics", headers={"authorization": f"Bearer {self.engine_key}"},
                               timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"prefixgate_engine_{name}"))

    async def until(self, done: Callable[[], bool], what: str, timeout: float = 600.0) -> None:
        """Poll the engine's metrics until ``done()``."""
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(done):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not reach {what!r} in {timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def idle(self) -> None:
        await self.until(lambda: self.engine_gauge("requests_running") + self.engine_gauge("requests_waiting") == 0,
                         "no request")


@contextlib.contextmanager
def prefill_target(args: argparse.Namespace, workdir: Path, root: Path) -> Iterator[Target]:
    """An engine of ``root`` behind a key; with ``--via gateway`` a gateway of ``root`` in
    front of it with the tenants ``quiet`` and ``heavy``, each its own API key."""
    flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory", "2",
             "--max-model-len", str(args.heavy_tokens + 64)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    key = secrets.token_urlsafe(24)
    with engine(*flags, log=workdir / f"engine-prefill-{root.name}.log", root=root, key=key) as (engine_url, _), \
            httpx.Client() as poller:
        model = poller.get(engine_url + "/health", timeout=30).json()["model"]
        if args.via == "engine":
            yield Target(engine_url, {t: {"authorization": f"Bearer {key}", TENANT_HEADER: t} for t in TENANTS},
                         engine_url, key, model, poller)
            return
        tenant_keys = {t: f"tenant-pressure-{t}-{secrets.token_urlsafe(16)}" for t in TENANTS}
        with gateway(engine_url, key, tenant_keys, workdir / f"gateway-{root.name}",
                     workdir / f"gateway-{root.name}.log", root) as url:
            yield Target(url, {t: {"authorization": f"Bearer {k}"} for t, k in tenant_keys.items()}, engine_url, key, model,
                         poller)


def heavy_prompt(tokens: int, k: int) -> list[int]:
    """``tokens`` pseudo-random token ids seeded by ``k``: a different ``k``, a different
    prompt from its first token (an arithmetic series of ``k`` repeated every 20,000
    values of ``k``, so the two heavy streams, ``k`` 100,000 apart, sent the same prompts
    and the second one only hit the first one's blocks)."""
    rng = random.Random(k)
    return [rng.randrange(1000, 21000) for _ in range(tokens)]


async def cold_prefill(target: Target, prompt: list[int]) -> float:
    """Seconds for one prompt alone (``max_tokens: 1``): a lone long prompt's throughput."""
    async with httpx.AsyncClient(base_url=target.url, timeout=3600, headers=target.headers["heavy"]) as client:
        start = time.perf_counter()
        response = await client.post("/v1/completions", json={"model": target.model, "prompt": prompt, "max_tokens": 1})
        response.raise_for_status()
        return time.perf_counter() - start


async def heavy_prompts(target: Target, clients: list[httpx.AsyncClient], prefix: list[int], new_tokens: int,
                        stop: asyncio.Event, first: int) -> int:
    """Keep one prompt in flight per client until ``stop`` (then cancel those in
    flight): ``prefix`` (cached by the cold prefill) then ``new_tokens`` distinct ones,
    so each computes ``new_tokens`` at long context. Returns how many were answered.

    The clients are made once (an httpx client's TLS context costs tens of ms of CPU)
    and bodies are encoded with orjson: on a 2-core machine the load generator's own
    CPU at a window's start would otherwise slow the engine's forwards it measures."""
    done = 0

    async def one_stream(k: int, client: httpx.AsyncClient) -> None:
        nonlocal done
        n = 0
        while not stop.is_set():
            prompt = prefix + heavy_prompt(new_tokens, first + k * 100_000 + n)  # never a hit past the prefix
            n += 1
            body = orjson.dumps({"model": target.model, "prompt": prompt, "max_tokens": 1})
            response = await client.post("/v1/completions", content=body,
                                         headers={"content-type": "application/json"})
            done += response.status_code == 200

    tasks = [asyncio.create_task(one_stream(k, client)) for k, client in enumerate(clients)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return done


async def alternate(target: Target, args: argparse.Namespace, prefix: list[int]) -> dict[str, Any]:
    """The heavy tenant's prompts alone for ``--heavy-alone-s`` (its prompt tokens
    computed per second, from the engine's counter), then ``--rounds`` rounds of an idle
    window (no other request in the engine) then a loaded one (the heavy tenant's
    prompts admitted and computing), each window ``--quiet-per-window`` quiet requests:
    both phases see the same background load."""
    idle: list[float] = []
    loaded: list[float] = []
    answered, loaded_s, computed_loaded = 0, 0.0, 0.0
    quiet = httpx.AsyncClient(base_url=target.url, timeout=600, headers=target.headers["quiet"])
    clients = [httpx.AsyncClient(base_url=target.url, timeout=3600, headers=target.headers["heavy"])
               for _ in range(args.heavy_streams)]
    computed = functools.partial(asyncio.to_thread, target.engine_gauge, "prompt_tokens_computed")
    # the heavy tenant alone first (before any quiet request: no other tenant active in
    # the engine's fairness window), its prompt tokens computed per second
    await target.idle()
    stop = asyncio.Event()
    heavy = asyncio.create_task(heavy_prompts(target, clients, prefix, args.heavy_new_tokens, stop, 1_000_000))
    await target.until(lambda: target.engine_gauge("requests_running") >= 1, "a heavy prompt running")
    before, start = await computed(), time.perf_counter()
    await asyncio.sleep(args.heavy_alone_s)  # a measurement window, not a synchronisation
    alone_rate = (await computed() - before) / (time.perf_counter() - start)
    stop.set()
    await heavy
    await warm_up(target.url, target.headers["quiet"], target.model)
    for r in range(args.rounds):
        await target.idle()
        idle += await quiet_requests(quiet, args.quiet_per_window, model=target.model)
        stop = asyncio.Event()
        heavy = asyncio.create_task(heavy_prompts(target, clients, prefix, args.heavy_new_tokens, stop, 1 + r * 1000))
        # one heavy prompt admitted (more wait for the quiet tenant's window to pass: the quiet
        # requests would then start without it active)
        await target.until(lambda: target.engine_gauge("requests_running") >= 1, "a heavy prompt running")
        quiet_computed: list[int] = []
        before, start = await computed(), time.perf_counter()
        loaded += await quiet_requests(quiet, args.quiet_per_window, model=target.model, computed=quiet_computed)
        loaded_s += time.perf_counter() - start
        computed_loaded += await computed() - before - sum(quiet_computed)
        stop.set()
        answered += await heavy
        print(f"round {r + 1}/{args.rounds}: idle p50 {statistics.median(idle) * 1000:.0f} ms, loaded p50 "
              f"{statistics.median(loaded) * 1000:.0f} ms, load {os.getloadavg()[0]:.1f}", flush=True)
    for client in [quiet, *clients]:
        await client.aclose()
    # engines without the counter (an older --before-root) report no rate
    has_counter = alone_rate > 0
    return {"idle": percentiles(idle), "loaded": percentiles(loaded), "heavy_answered_while_loaded": answered,
            "loaded_seconds": loaded_s,
            "heavy_tokens_per_s_alone": alone_rate if has_counter else None,
            "heavy_tokens_per_s_while_loaded": computed_loaded / loaded_s if has_counter else None}


def case_prefill(args: argparse.Namespace, workdir: Path, root: Path) -> dict[str, Any]:
    """One engine (the checkout ``root``), through its gateway unless ``--via engine``:
    a lone cold prefill of ``--heavy-tokens`` (timed: a lone long prompt's throughput;
    it caches the heavy tenant's prefix), then (:func:`alternate`) the heavy tenant
    alone for ``--heavy-alone-s``, a warm-up, and idle and loaded windows alternating."""
    cold = heavy_prompt(args.heavy_tokens, 0)
    with prefill_target(args, workdir, root) as target:
        cold_s = asyncio.run(cold_prefill(target, cold))
        prefix = cold[: args.heavy_tokens - args.heavy_new_tokens]
        result = asyncio.run(alternate(target, args, prefix))
    result.update({"root": str(root), "via": args.via, "cold_prefill_s": cold_s})
    result["p99_ratio"] = result["loaded"]["p99_ms"] / result["idle"]["p99_ms"]
    result["p50_ratio"] = result["loaded"]["p50_ms"] / result["idle"]["p50_ms"]
    return result


# --------------------------------------------------------------------------- images

def zero_pngs(count: int, cache: Path) -> list[str]:
    """``count`` distinct IMAGE_SIDE^2 RGB PNGs of zeros as data: URLs (cached on disk)."""
    from PIL import Image

    cache.mkdir(parents=True, exist_ok=True)
    urls = []
    for k in range(count):
        path = cache / f"zeros-{IMAGE_SIDE}-{k}.png"
        if not path.exists():
            image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE))
            image.putpixel((k, 0), (255, k % 256, 1))
            buf = io.BytesIO()
            image.save(buf, format="PNG", compress_level=9)
            path.write_bytes(buf.getvalue())
        urls.append("data:image/png;base64," + base64.b64encode(path.read_bytes()).decode())
    return urls


async def image_requests(url: str, urls: list[str], requests: int, per_request: int) -> list[int]:
    async def one(r: int, client: httpx.AsyncClient) -> int:
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"Describe these {r}"}]
        parts += [{"type": "image_url", "image_url": {"url": u}}
                  for u in urls[r * per_request:(r + 1) * per_request]]
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
        response = await client.post("/v1/chat/completions", json=body, headers={TENANT_HEADER: f"img{r}"})
        return response.status_code

    async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
        return list(await asyncio.gather(*(one(r, client) for r in range(requests))))


def case_images(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tiny_vlm import build_tiny_llava

    from engine.model_store import ensure_converted_model

    model_dir = build_tiny_llava(str(ensure_converted_model()), workdir / "tiny-llava")
    per_request = 8
    urls = zero_pngs(args.image_requests * per_request, Path(tempfile.gettempdir()) / "prefixgate-bench-images")
    flags = ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "0.05"]
    if args.max_image_pixels:
        flags += ["--max-image-pixels-in-flight", str(args.max_image_pixels)]
    with engine(*flags, log=workdir / "engine-images.log", root=args.engine_root) as (url, pid):
        asyncio.run(warm_up(url, {TENANT_HEADER: "quiet"}))
        idle_rss = rss_mib(pid)
        peak = [idle_rss]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                with contextlib.suppress(OSError, RuntimeError):
                    peak.append(rss_mib(pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def both() -> tuple[list[int], list[float], float]:
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=url, timeout=600, headers={TENANT_HEADER: "quiet"}) as client:
                quiet = asyncio.create_task(quiet_requests(client, 100_000, stop))
                start = time.perf_counter()
                statuses = await image_requests(url, urls, args.image_requests, per_request)
                elapsed = time.perf_counter() - start
                stop.set()
                return statuses, await quiet, elapsed

        statuses, quiet, elapsed = asyncio.run(both())
        done.set()
        sampler.join()
        time.sleep(3)
        after_rss = rss_mib(pid)
    return {"budget_pixels": args.max_image_pixels, "statuses": statuses, "seconds": elapsed,
            "rss_idle_mib": idle_rss, "rss_peak_mib": max(peak), "rss_after_3s_mib": after_rss,
            "quiet_during": percentiles(quiet) if quiet else {"n": 0}}


# --------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("prefill", "images"), default=None)
    parser.add_argument("--via", choices=("gateway", "engine"), default="gateway",
                        help="prefill case: the tenants send through a gateway (default; each its own API key) "
                        "or straight to the engine (the tenant header)")
    parser.add_argument("--rounds", type=int, default=4, help="prefill case: idle/loaded window pairs")
    parser.add_argument("--quiet-per-window", type=int, default=25,
                        help="prefill case: quiet requests per window (p99 over rounds x this per phase)")
    parser.add_argument("--heavy-tokens", type=int, default=8000)
    parser.add_argument("--heavy-new-tokens", type=int, default=256,
                        help="tokens of each loaded heavy prompt past its cached prefix (computed at long context)")
    parser.add_argument("--before-root", type=Path, default=None,
                        help="prefill case: first on this checkout (engine and gateway): a before/after in one run")
    parser.add_argument("--heavy-streams", type=int, default=2)
    parser.add_argument("--heavy-alone-s", type=float, default=5.0,
                        help="prefill case: seconds of the heavy tenant alone (its prompt tokens/s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--image-requests", type=int, default=4)
    parser.add_argument("--max-image-pixels", type=int, default=320_000_000,
                        help="--max-image-pixels-in-flight of the images case (0: not passed, for older engines)")
    parser.add_argument("--engine-root", type=Path, default=ROOT,
                        help="checkout whose engine the images case runs (another one's for a before/after)")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count(),
                               "load_before": os.getloadavg()[0], "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="prefixgate-tenant-pressure-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "prefill"):
            if args.before_root is not None:  # the same run: before, then this checkout
                results["prefill_before"] = case_prefill(args, workdir, args.before_root)
                print(json.dumps({"prefill_before": results["prefill_before"]}), flush=True)
            results["prefill"] = case_prefill(args, workdir, ROOT)
        if args.only in (None, "images"):
            results["images"] = case_images(args, workdir)
    results["load_after"] = os.getloadavg()[0]
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def print_table(r: dict[str, Any]) -> None:
    print(f"load {r['load_before']:.1f} -> {r['load_after']:.1f}, {r['cpus']} cpus")
    for key in ("prefill_before", "prefill"):
        if key not in r:
            continue
        p = r[key]
        print(f"{key} ({p['root']}, via {p['via']}): quiet tenant TTFT (max_tokens 1) idle and while another "
              f"tenant sends {r['args']['heavy_tokens']}-token prompts ({r['args']['heavy_tokens'] - r['args']['heavy_new_tokens']} "
              f"cached + {r['args']['heavy_new_tokens']} new, {r['args']['heavy_streams']} in flight; budget "
              f"{r['args']['max_num_batched_tokens']} tokens/step), {r['args']['rounds']} alternating rounds")
        print(f"  cold {r['args']['heavy_tokens']}-token prefill alone {p['cold_prefill_s']:.1f} s; heavy prompts "
              f"answered while loaded {p['heavy_answered_while_loaded']} in {p['loaded_seconds']:.0f} s")
        if p.get("heavy_tokens_per_s_alone") is not None:
            print(f"  heavy tenant's prompt tokens computed: {p['heavy_tokens_per_s_alone']:.0f}/s alone, "
                  f"{p['heavy_tokens_per_s_while_loaded']:.0f}/s while the quiet tenant sends "
                  f"({p['heavy_tokens_per_s_while_loaded'] / p['heavy_tokens_per_s_alone']:.2f}x)")
        print(f"  {'phase':<10} {'n':>4} {'p50 ms':>10} {'p99 ms':>10} {'p99/idle p99':>13}")
        for name in ("idle", "loaded"):
            row = p[name]
            print(f"  {name:<10} {row['n']:>4} {row['p50_ms']:>10.1f} {row['p99_ms']:>10.1f} "
                  f"{row['p99_ms'] / p['idle']['p99_ms']:>12.2f}x")
        print(f"  issue 29 target: loaded p99 within 2x idle p99: {p['p99_ratio']:.2f}x "
              f"({'met' if p['p99_ratio'] <= 2 else 'NOT met'})")
    if "images" in r:
        i = r["images"]
        q = i["quiet_during"]
        print(f"{len(i['statuses'])} requests x 8 images {IMAGE_SIDE}x{IMAGE_SIDE}, budget {i['budget_pixels']:,} "
              f"pixels: statuses {i['statuses']} in {i['seconds']:.1f} s")
        print(f"  engine RSS idle {i['rss_idle_mib']:.0f} MiB, peak {i['rss_peak_mib']:.0f} MiB, "
              f"3 s after {i['rss_after_3s_mib']:.0f} MiB")
        if q["n"]:
            print(f"  quiet tenant meanwhile: {q['n']} answers, p50 {q['p50_ms']:.1f} ms, p99 {q['p99_ms']:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
