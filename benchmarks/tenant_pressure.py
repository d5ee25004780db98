"""One tenant's heavy work against another's short requests, on one ``prefixgate engine``.

Two cases (issue 29, items 2 and 3), each against a real engine process on loopback:

* ``prefill``: a quiet tenant's one-token requests (a ~20-token chat, sequential),
  TTFT (the whole answer of ``max_tokens: 1``) p50/p99 on an idle engine; then one
  cold prompt of ``--heavy-tokens`` distinct tokens (8k by default) alone, timed
  (a lone long prompt's throughput); then the quiet tenant again while a heavy
  tenant keeps ``--heavy-streams`` prompts in flight, each that prompt's cached
  first ``heavy_tokens - heavy_new_tokens`` tokens and ``--heavy-new-tokens`` new
  ones, so the engine keeps computing at 7-8k context (a cold 8k prompt spends
  most of its time at short context, and minutes on a 2-core VM). With
  ``--before-root`` the same on another checkout's engine first (before/after in
  one run); ``--fcfs-requests N`` adds a run without the tenant header. Target:
  loaded p99 within 2x idle p99.
* ``images``: a tiny random LLaVA (``tests/engine/multimodal/tiny_vlm.py``) served
  with ``--max-image-pixels-in-flight``; ``--image-requests`` requests at once, each
  with 8 distinct 6320x6320 PNGs of zeros (one pixel differs), while a quiet tenant
  keeps sending text requests. The engine's RSS (``/proc/PID/status``) idle, peak
  and 3 s after the last answer; the image requests' statuses; the quiet tenant's
  latency p50/p99 meanwhile.

Prints a table and writes benchmarks/results/tenant_pressure.json.
Usage: python benchmarks/tenant_pressure.py [--only prefill|images] [--quiet-requests 20]
       [--before-root ../checkout-before --before-quiet-requests 5]
       [--max-image-pixels 0 --engine-root ../other-checkout]   (the images case on an older engine)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "engine" / "multimodal"))
from servers import free_port, wait_healthy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "tenant_pressure.json"
TENANT_HEADER = "x-prefixgate-tenant"
IMAGE_SIDE = 6320


@contextlib.contextmanager
def engine(*flags: str, log: Path, root: Path = ROOT) -> Iterator[tuple[str, int]]:
    """``prefixgate engine`` of the checkout ``root`` with ``flags``; yields (base URL, pid)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PREFIXGATE_ENGINE_API_KEY", None)
    argv = [sys.executable, "-m", "gateway.cli", "engine", "--port", str(port), "--log-level", "warning", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc.pid
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


async def quiet_requests(url: str, count: int, tenant: str | None, stop: asyncio.Event | None = None,
                         ) -> list[float]:
    """Sequential one-token chats; seconds each (only 200s count)."""
    headers = {TENANT_HEADER: tenant} if tenant else {}
    out: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(count):
            if stop is not None and stop.is_set():
                break
            body = {"max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Quiet question number {i}: say hi"}]}
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            if response.status_code == 200:
                out.append(time.perf_counter() - start)
    return out


# --------------------------------------------------------------------------- prefill

def heavy_prompt(tokens: int, k: int) -> list[int]:
    """``tokens`` distinct-looking token ids; a different ``k``, a different prompt."""
    base = 1000 + (k * 7919) % 20000
    return [base + (i * 13) % 20000 for i in range(tokens)]


async def cold_prefill(url: str, prompt: list[int]) -> float:
    """Seconds for one prompt alone (``max_tokens: 1``): a lone long prompt's throughput."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        start = time.perf_counter()
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                     headers={TENANT_HEADER: "heavy"})
        response.raise_for_status()
        return time.perf_counter() - start


async def heavy_prompts(url: str, prefix: list[int], new_tokens: int, streams: int, tenant: str | None,
                        stop: asyncio.Event) -> int:
    """Keep ``streams`` prompts in flight until ``stop``: ``prefix`` (cached by the cold
    prefill) then ``new_tokens`` distinct ones, so each computes ``new_tokens`` at long
    context. Returns how many were answered."""
    headers = {TENANT_HEADER: tenant} if tenant else {}
    done = 0

    async def one_stream(k: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            n = 0
            while not stop.is_set():
                prompt = prefix + heavy_prompt(new_tokens, 1 + k * 1000 + n)  # never a hit past the prefix
                n += 1
                response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                             headers=headers)
                done += response.status_code == 200

    tasks = [asyncio.create_task(one_stream(k)) for k in range(streams)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return done


async def loaded(url: str, args: argparse.Namespace, prefix: list[int], count: int, header: bool,
                 ) -> tuple[list[float], int, float]:
    stop = asyncio.Event()
    heavy = asyncio.create_task(heavy_prompts(url, prefix, args.heavy_new_tokens, args.heavy_streams,
                                              "heavy" if header else None, stop))
    await asyncio.sleep(args.heavy_head_start)  # the heavy prompts are in the engine first
    start = time.perf_counter()
    times = await quiet_requests(url, count, "quiet" if header else None)
    elapsed = time.perf_counter() - start
    stop.set()
    return times, await heavy, elapsed


def case_prefill(args: argparse.Namespace, workdir: Path, root: Path, quiet: int) -> dict[str, Any]:
    """One engine (the checkout ``root``): the quiet tenant idle, a lone cold prefill of
    ``--heavy-tokens``, then the quiet tenant while the heavy tenant's prompts (that
    prompt's first ``heavy_tokens - heavy_new_tokens`` tokens, cached, then new ones)
    keep the engine computing at long context."""
    flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory", "2",
             "--max-model-len", str(args.heavy_tokens + 64)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    cold = heavy_prompt(args.heavy_tokens, 0)
    with engine(*flags, log=workdir / f"engine-prefill-{root.name}.log", root=root) as (url, _):
        asyncio.run(quiet_requests(url, 3, "quiet"))  # warm-up
        idle = asyncio.run(quiet_requests(url, quiet, "quiet"))
        time.sleep(args.pause)  # past the scheduler's window: the quiet tenant no longer counts as active
        cold_s = asyncio.run(cold_prefill(url, cold))
        prefix = cold[: args.heavy_tokens - args.heavy_new_tokens]
        fair, heavy_done, seconds = asyncio.run(loaded(url, args, prefix, quiet, header=True))
        fcfs, _, _ = (asyncio.run(loaded(url, args, prefix, args.fcfs_requests, header=False))
                      if args.fcfs_requests else ([], 0, 0.0))
    result: dict[str, Any] = {"root": str(root), "idle": percentiles(idle), "tenant_header": percentiles(fair),
                              "cold_prefill_s": cold_s, "heavy_answered_while_loaded": heavy_done,
                              "loaded_seconds": seconds}
    result["p99_ratio_tenant_header"] = result["tenant_header"]["p99_ms"] / result["idle"]["p99_ms"]
    if fcfs:
        result["shared_key_fcfs"] = percentiles(fcfs)
        result["p99_ratio_shared_key"] = result["shared_key_fcfs"]["p99_ms"] / result["idle"]["p99_ms"]
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
        asyncio.run(quiet_requests(url, 3, "quiet"))
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
            quiet = asyncio.create_task(quiet_requests(url, 100_000, "quiet", stop))
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
    parser.add_argument("--quiet-requests", type=int, default=20)
    parser.add_argument("--fcfs-requests", type=int, default=0,
                        help="quiet requests in a shared-key (FCFS) run, slow; 0 (default) skips it")
    parser.add_argument("--heavy-tokens", type=int, default=8000)
    parser.add_argument("--heavy-new-tokens", type=int, default=1000,
                        help="tokens of each loaded heavy prompt past its cached prefix (computed at long context)")
    parser.add_argument("--pause", type=float, default=11.0,
                        help="seconds between the idle quiet requests and the cold prefill (the scheduler's "
                        "fairness window is 10 s)")
    parser.add_argument("--before-root", type=Path, default=None,
                        help="prefill case: first on this checkout's engine (a before/after in one run)")
    parser.add_argument("--before-quiet-requests", type=int, default=None,
                        help="quiet requests on --before-root (default: --quiet-requests)")
    parser.add_argument("--heavy-streams", type=int, default=2)
    parser.add_argument("--heavy-head-start", type=float, default=2.0)
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
                results["prefill_before"] = case_prefill(args, workdir, args.before_root,
                                                         args.before_quiet_requests or args.quiet_requests)
                print(json.dumps({"prefill_before": results["prefill_before"]}), flush=True)
            results["prefill"] = case_prefill(args, workdir, ROOT, args.quiet_requests)
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
        print(f"{key} ({p['root']}): quiet tenant TTFT (max_tokens 1) while another sends "
              f"{r['args']['heavy_tokens']}-token prompts (budget {r['args']['max_num_batched_tokens']} tokens/step); "
              f"cold {r['args']['heavy_tokens']}-token prefill alone {p['cold_prefill_s']:.1f} s; "
              f"heavy prompts answered while loaded {p['heavy_answered_while_loaded']} in {p['loaded_seconds']:.0f} s")
        print(f"  {'case':<28} {'n':>4} {'p50 ms':>10} {'p99 ms':>10} {'p99/idle':>9}")
        idle = p["idle"]["p99_ms"]
        for name in ("idle", "tenant_header", "shared_key_fcfs"):
            if name not in p:
                continue
            row = p[name]
            print(f"  {name:<28} {row['n']:>4} {row['p50_ms']:>10.1f} {row['p99_ms']:>10.1f} "
                  f"{row['p99_ms'] / idle:>8.2f}x")
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
