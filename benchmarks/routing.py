"""Routing over 3 engine replicas: round-robin vs SGLang's cache_aware router vs prefixgate.

Processes on loopback: three ``prefixgate engine`` replicas (the bundled
SmolLM2-135M, one torch thread each, KV events on ZMQ), SGLang's router
(``sglang-router`` from PyPI, run from its own virtual environment given by
``--sglang-python``) twice in front of the same replicas (``round_robin`` and
``cache_aware``), ``prefixgate gateway`` with the three replicas and their events,
and this load generator (httpx, streaming, ``stream_options.include_usage``).

Workloads (each run once per router in this one run, routers one after the other
so they never compete for the replicas; every router's prompts carry their own
nonce so no router profits from blocks another one cached):

a. easy: 8 tenants, ~700-token system prompts, 4 turns each (growing history),
   interleaved. Also run against one replica alone: the single-engine hit rate.
b. KV pressure: 12 tenants on replicas restarted with small pools (each holds
   about 3.5 tenants' prefixes), 3 turns: blocks are evicted.
c. skew: 2 hot tenants send 70% of 40 requests, 4 clients at once: load balance
   and locality conflict.
d. tools: one tenant whose 6 clients send the same 4 tools in different tool
   orders and key orders, 3 questions each.

Per router and workload: hit rate (sum of cached / sum of prompt tokens), mean and
p99 client-side TTFT (first streamed token), errors; for prefixgate also the share
of requests whose predicted cached tokens equalled the engine's report.

Prints a table and writes JSON to benchmarks/results/routing.json.
Usage: python benchmarks/routing.py [--sglang-python /path/to/venv/bin/python] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from servers import free_port, wait_healthy  # this directory

from gateway.config.replica_spec import DEFAULT_LOAD_COST_TOKENS, DEFAULT_MISS_WEIGHT

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
WORDS = ["river", "bridge", "lantern", "copper", "meadow", "orchard", "harbor", "violet", "canyon", "ember",
         "willow", "quartz", "falcon", "saddle", "thistle", "beacon", "marble", "juniper", "cobalt", "prairie"]


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            if process.poll() is None:
                process.terminate()
        for process in started:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def start_engines(procs: list[subprocess.Popen[bytes]], kv_gib: float) -> list[dict[str, str]]:
    replicas = []
    for _ in range(3):
        port, events, replay = free_port(), free_port(), free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--port", str(port), "--kv-cache-memory", str(kv_gib),
             "--kv-events-config", json.dumps(config), "--log-level", "warning"],
            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        replicas.append({"url": f"http://127.0.0.1:{port}", "events": config["endpoint"],
                         "replay": config["replay_endpoint"]})
    for replica, process in zip(replicas, procs[-3:], strict=True):
        wait_healthy(replica["url"], process)
    return replicas


def start_routers(procs: list[subprocess.Popen[bytes]], replicas: list[dict[str, str]], data_dir: Path,
                  sglang_python: str | None) -> dict[str, str]:
    routers: dict[str, str] = {}
    if sglang_python:
        for policy in ("round_robin", "cache_aware"):
            port = free_port()
            procs.append(subprocess.Popen(
                [sglang_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--policy", policy, "--worker-urls", *[r["url"] for r in replicas], "--log-level", "warn",
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                stdout=subprocess.DEVNULL, stderr=(data_dir / f"sglang-{policy}.log").open("wb")))
            wait_healthy(f"http://127.0.0.1:{port}", procs[-1], timeout=120)
            routers[f"sglang {policy}"] = f"http://127.0.0.1:{port}"
    port = free_port()
    upstreams = [f"{r['url']},events={r['events']},replay={r['replay']}" for r in replicas]
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "gateway", *[a for u in upstreams for a in ("--upstream", u)],
         "--port", str(port), "--data-dir", str(data_dir), "--health-interval", "1", "--log-level", "warning"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=(data_dir / "gateway.log").open("ab")))
    wait_healthy(f"http://127.0.0.1:{port}", procs[-1], timeout=120)
    routers["prefixgate"] = f"http://127.0.0.1:{port}"
    return routers


# --------------------------------------------------------------------------- workloads

def system_prompt(tenant: str, nonce: str, words: int = 330) -> str:
    rng = random.Random(f"{tenant}/{nonce}")
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    # The tenant comes first, so tenants share no block even without salts: the routers are
    # compared on routing, not on prefixgate's per-tenant isolation.
    return f"Team {tenant} [{nonce}]. You are this team's assistant. Reference notes: {body}. Answer in one word."


def conversation(tenant: str, nonce: str, turns: int) -> list[list[dict[str, Any]]]:
    """Turn k: the system prompt, k earlier exchanges (fixed answers), question k."""
    system = {"role": "system", "content": system_prompt(tenant, nonce)}
    out = []
    history: list[dict[str, Any]] = []
    for k in range(turns):
        question = {"role": "user", "content": f"Question {k} of {tenant}: which word comes first?"}
        out.append([system, *history, question])
        history += [question, {"role": "assistant", "content": f"Answer {k}."}]
    return out


def workload_easy(nonce: str, tenants: int = 8, turns: int = 4) -> list[tuple[str, dict[str, Any]]]:
    convs = {f"t{i}": conversation(f"t{i}", nonce, turns) for i in range(tenants)}
    return [(t, {"messages": convs[t][k]}) for k in range(turns) for t in convs]


def workload_skew(nonce: str, requests: int = 40) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(f"skew/{nonce}")
    out = []
    for i in range(requests):
        tenant = rng.choice(["hot0", "hot1"]) if rng.random() < 0.7 else f"cold{rng.randrange(6)}"
        question = {"role": "user", "content": f"Request {i}: which word comes first?"}
        out.append((tenant, {"messages": [{"role": "system", "content": system_prompt(tenant, nonce)}, question]}))
    return out


TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} for a customer.",
                                      "parameters": {"type": "object", "required": ["id"],
                                                     "properties": {"id": {"type": "string"},
                                                                    "verbose": {"type": "boolean"}}}}}
    for name in ("lookup_order", "book_repair", "cancel_booking", "refund_payment")
]


def _flip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _flip(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_flip(v) for v in value]
    return value


def workload_tools(nonce: str, clients: int = 6, questions: int = 3) -> list[tuple[str, dict[str, Any]]]:
    system = {"role": "system", "content": system_prompt("tools", nonce, words=200)}
    variants = []
    for c in range(clients):
        tools = copy.deepcopy(TOOLS)
        random.Random(f"{nonce}/{c}").shuffle(tools)
        variants.append([_flip(t) for t in tools] if c % 2 else tools)
    out = []
    for q in range(questions):
        for c in range(clients):
            question = {"role": "user", "content": f"Client {c} question {q}: where is order {q}?"}
            out.append(("tools", {"messages": [system, question], "tools": variants[c]}))
    return out


# --------------------------------------------------------------------------- measurement

async def one_request(client: httpx.AsyncClient, url: str, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    payload = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, **body}
    started = time.perf_counter()
    ttft = None
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=payload,
                                 headers={"authorization": f"Bearer key-{tenant}"}) as response:
            if response.status_code != 200:
                await response.aread()
                return {"error": response.status_code}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if ttft is None and event.get("choices"):
                    ttft = time.perf_counter() - started
                if event.get("usage"):
                    usage = event["usage"]
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    if usage is None:
        return {"error": "no usage"}
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started,
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def run_routers(routers: dict[str, str], requests: dict[str, list[tuple[str, dict[str, Any]]]],
                      concurrency: int) -> dict[str, list[dict[str, Any]]]:
    """Each router's request list, ``concurrency`` clients at a time, one router after the other
    (routers never compete for the replicas; their nonces keep their blocks apart)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in routers}
    async with httpx.AsyncClient(timeout=600) as client:
        for name, url in routers.items():
            queue = list(requests[name])

            async def worker(name: str = name, url: str = url, queue: list[Any] = queue) -> None:
                while queue:
                    tenant, body = queue.pop(0)
                    results[name].append(await one_request(client, url, tenant, body))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok)
    prompt = sum(r["prompt"] for r in ok)
    return {
        "requests": len(rows), "errors": len(rows) - len(ok),
        "hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else None,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
    }


def predictions(db: Path, since_id: int) -> tuple[int, int, int]:
    """(rows after ``since_id``, rows with a prediction and a report, exact ones) in the gateway's stats."""
    with sqlite3.connect(db) as connection:
        got = connection.execute(
            "SELECT predicted_cached_tokens, cached_tokens FROM request_log WHERE id > ?", (since_id,)).fetchall()
    both = [(p, c) for p, c in got if p is not None and c is not None]
    return len(got), len(both), sum(p == c for p, c in both)


def last_id(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        return int(connection.execute("SELECT coalesce(max(id), 0) FROM request_log").fetchone()[0])


def wait_rows(db: Path, since_id: int, count: int) -> None:
    deadline = time.monotonic() + 60
    while predictions(db, since_id)[0] < count and time.monotonic() < deadline:
        time.sleep(0.2)


def run_workload(name: str, routers: dict[str, str], make: Any, concurrency: int, db: Path,
                 report: dict[str, Any]) -> None:
    requests = {router: make(f"{name}-{router}-{time.time_ns()}") for router in routers}
    since = last_id(db)
    started = time.perf_counter()
    results = asyncio.run(run_routers(routers, requests, concurrency))
    entry = {router: summarize(rows) for router, rows in results.items()}
    wait_rows(db, since, len(requests["prefixgate"]))
    _, compared, exact = predictions(db, since)
    entry["prefixgate"]["predicted_exact"] = exact
    entry["prefixgate"]["predicted_compared"] = compared
    entry["wall_s"] = time.perf_counter() - started
    report["workloads"][name] = entry
    print(f"  {name}: {entry['wall_s']:.0f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON"),
                        help="python of a virtual environment with sglang-router installed")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--workloads", default="a,b,c,d", help="which workloads to run (default a,b,c,d)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the gateway's database and the logs here (default: a temporary directory)")
    args = parser.parse_args()
    quick = args.quick
    report: dict[str, Any] = {"machine": platform.platform(), "cpus": os.cpu_count(), "model": MODEL,
                              "sglang_router": args.sglang_python is not None, "workloads": {},
                              "prefixgate_routing": {"load_cost_tokens": DEFAULT_LOAD_COST_TOKENS,
                                                     "miss_weight": DEFAULT_MISS_WEIGHT}}
    with tempfile.TemporaryDirectory() as tmp:
        data = args.workdir or Path(tmp)
        data.mkdir(parents=True, exist_ok=True)
        db = data / "prefixgate.db"
        selected = set(args.workloads.split(","))
        if selected & {"a", "c", "d"}:
            print("phase 1: replicas with 0.2 GiB of KV cache each", flush=True)
            with processes() as procs:
                replicas = start_engines(procs, 0.2)
                routers = start_routers(procs, replicas, data, args.sglang_python)
                if "a" in selected:  # also against one replica alone: the single-engine hit rate
                    run_workload("a_easy", {**routers, "single engine": replicas[0]["url"]},
                                 lambda n: workload_easy(n, 4 if quick else 8, 2 if quick else 4), 1, db, report)
                if "c" in selected:
                    run_workload("c_skew", routers, lambda n: workload_skew(n, 16 if quick else 40), 4, db, report)
                if "d" in selected:
                    run_workload("d_tools", routers,
                                 lambda n: workload_tools(n, 4 if quick else 6, 2 if quick else 3), 2, db, report)
        if "b" in selected:
            print("phase 2: replicas with 0.06 GiB of KV cache each (about 3.5 tenants' prefixes)", flush=True)
            with processes() as procs:
                replicas = start_engines(procs, 0.06)
                routers = start_routers(procs, replicas, data, args.sglang_python)
                run_workload("b_pressure", routers,
                             lambda n: workload_easy(n, 6 if quick else 12, 2 if quick else 3), 2, db, report)
    print_table(report)
    RESULTS.mkdir(exist_ok=True)
    name = "routing.json" if args.workloads == "a,b,c,d" and not quick else f"routing-{args.workloads.replace(',', '')}.json"
    (RESULTS / name).write_text(json.dumps(report, indent=2))
    return 0


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'workload':<12} {'router':<20} {'req':>4} {'err':>4} {'hit rate':>9} {'mean TTFT':>10} "
          f"{'p99 TTFT':>9} {'exact pred.':>12}")
    for workload, entry in sorted(report["workloads"].items()):
        for router, stats in entry.items():
            if router == "wall_s":
                continue
            hit = "-" if stats["hit_rate"] is None else f"{stats['hit_rate']:.1%}"
            mean = "-" if stats["mean_ttft_s"] is None else f"{stats['mean_ttft_s']:.3f} s"
            p99 = "-" if stats["p99_ttft_s"] is None else f"{stats['p99_ttft_s']:.3f} s"
            exact = f"{stats['predicted_exact']}/{stats['predicted_compared']}" if "predicted_exact" in stats else ""
            print(f"{workload:<12} {router:<20} {stats['requests']:>4} {stats['errors']:>4} {hit:>9} {mean:>10} "
                  f"{p99:>9} {exact:>12}")


if __name__ == "__main__":
    sys.exit(main())
