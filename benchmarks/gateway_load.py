"""The gateway under load: requests per second and latency as concurrency grows.

Three kinds of processes on loopback: the fake OpenAI upstream of
``gateway_overhead.py`` (raw ASGI under uvicorn, answers at once), ``prefixgate
gateway`` in front of it (open mode, warnings and canonicalization on, a real
SQLite stats database), and ``wrk`` (one thread, keep-alive connections; installed
from Debian's packages when missing and this runs as root). For each mode (JSON,
streaming) and each concurrency (1, 16, 128, 512) wrk runs against the upstream
directly, then through the gateway, so both see the same machine. The body is a
realistic agent request: a ~600-token system prompt and 8 tools.

After the run the gateway is stopped with SIGTERM and its ``request_log`` rows are
counted: every request wrk saw answered must have its row (requests still in
flight when wrk stops its clock are answered or cut off, and have rows too).

Two more phases: a quiet tenant's sequential latency, idle and while another
tenant posts 7.5 MiB system prompts full of dates (the prefix check's budget and
helper process at work); and a one-worker gateway killed with SIGKILL after 2 s
of sequential requests, to measure how many answered requests lost their rows
(bounded by the stats writer's flush interval).

Prints a table and writes JSON to benchmarks/results/gateway_load.json.
Usage: python benchmarks/gateway_load.py [--duration 8] [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import cpu_seconds, free_port, wait_healthy

from gateway.stats.writer import FLUSH_INTERVAL_S

RESULTS = Path(__file__).resolve().parent / "results"
OVERHEAD = Path(__file__).resolve().parent / "gateway_overhead.py"
LEVELS = (1, 16, 128, 512)

SYSTEM = (
    "You are the support assistant of Northwind Cycles, a bicycle shop with three branches. "
    "Answer in the customer's language, in at most three short sentences, and never invent "
    "order numbers, prices or opening hours: look them up with the tools. If a question is "
    "about a repair, ask for the bicycle's make and the problem before booking. Escalate to a "
    "human when the customer is angry, mentions an injury or asks for a refund above 200 euros. "
) * 6


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": sorted(properties),
                       "properties": {key: {"type": kind} for key, kind in properties.items()}}}}


BODY = {
    "model": "fake-model",
    "max_tokens": 64,
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my order?"}],
    "tools": [
        _tool("lookup_order", "Find an order by number.", order_number="string"),
        _tool("book_repair", "Book a repair slot.", branch="string", day="string", bike="string"),
        _tool("opening_hours", "Opening hours of a branch.", branch="string"),
        _tool("price_of", "Price of a product.", sku="string"),
        _tool("stock_of", "Units in stock per branch.", sku="string"),
        _tool("refund", "Start a refund.", order_number="string", amount="number"),
        _tool("escalate", "Hand the chat to a human.", reason="string"),
        _tool("track_parcel", "Carrier status of a parcel.", tracking_id="string"),
    ],
}

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer load-test-key"
local f = assert(io.open(os.getenv("LOAD_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()

done = function(summary, latency, requests)
  local e = summary.errors
  local out = assert(io.open(os.getenv("LOAD_OUT"), "w"))
  out:write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "max_us": %d, '
    .. '"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, e.connect, e.read, e.write, e.status, e.timeout))
  out:close()
end
"""


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit("wrk is missing: install it (Debian: apt-get install wrk) and run again")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True)
    return shutil.which("wrk") or "wrk"


def run_wrk(wrk: str, url: str, concurrency: int, duration: int, body: Path, script: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "LOAD_BODY": str(body), "LOAD_OUT": out.name}
        subprocess.run(
            [wrk, "-t1", f"-c{concurrency}", f"-d{duration}s", "--timeout", "10s", "-s", str(script), url],
            env=env, check=True, stdout=subprocess.DEVNULL,
        )
        raw = json.loads(Path(out.name).read_text())
    seconds = raw["duration_us"] / 1e6
    errors = raw["connect"] + raw["read"] + raw["write"] + raw["status"] + raw["timeout"]
    return {
        "requests": raw["requests"], "rps": (raw["requests"] - raw["status"]) / seconds,
        "p50_ms": raw["p50_us"] / 1000, "p99_ms": raw["p99_us"] / 1000, "max_ms": raw["max_us"] / 1000,
        "errors": errors, "error_kinds": {k: raw[k] for k in ("connect", "read", "write", "status", "timeout")},
    }


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its descendants (the gateway's workers): unlike req/s it
    does not depend on how much of the shared machine the gateway got."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            total += cpu_seconds(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(child) for child in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def sequential_latencies(url: str, key: str, body: dict[str, Any], n: int) -> list[float]:
    import httpx

    latencies = []
    with httpx.Client(headers={"authorization": f"Bearer {key}"}, timeout=60) as client:
        for _ in range(n):
            started = time.perf_counter()
            response = client.post(url, json=body)
            latencies.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def noisy_neighbour(gateway_base: str, n: int) -> dict[str, Any]:
    """Another tenant's latency, idle and while 7.5 MiB system prompts full of dates are checked."""
    import httpx

    url = gateway_base + "/v1/chat/completions"
    small = {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "Ping?"}]}
    line = "Meeting on 2026-11-23 at 10:42:17, next on 2026-11-24. "
    big = {"model": "fake-model", "max_tokens": 8, "messages": [
        {"role": "system", "content": line * (int(7.5 * 1024 * 1024) // len(line))},
        {"role": "user", "content": "Summarise."}]}
    sequential_latencies(url, "quiet-tenant", small, 50)  # warm-up
    idle = sequential_latencies(url, "quiet-tenant", small, n)
    stop, big_runs = threading.Event(), []

    def noisy() -> None:
        with httpx.Client(headers={"authorization": "Bearer noisy-tenant"}, timeout=120) as client:
            while not stop.is_set():
                started = time.perf_counter()
                response = client.post(url, json=big)
                codes = response.headers.get("x-prefixgate-warnings", "")
                big_runs.append({"status": response.status_code, "ms": (time.perf_counter() - started) * 1000,
                                 "warning_codes": codes, "response_bytes": len(response.content)})

    thread = threading.Thread(target=noisy)
    thread.start()
    try:
        loaded = sequential_latencies(url, "quiet-tenant", small, n)
        while len(big_runs) < 2 and thread.is_alive():
            loaded += sequential_latencies(url, "quiet-tenant", small, 20)
    finally:
        stop.set()
        thread.join()
    requests = 50 + len(idle) + len(loaded) + len(big_runs)
    return {"requests": requests, "idle_p50_ms": pct(idle, 50), "idle_p99_ms": pct(idle, 99),
            "loaded_p50_ms": pct(loaded, 50), "loaded_p99_ms": pct(loaded, 99),
            "p99_ratio": pct(loaded, 99) / pct(idle, 99), "quiet_requests": len(loaded), "big_requests": big_runs}


def sigkill_durability(gateway_cmd: list[str], data_dir: Path, seconds: float) -> dict[str, Any]:
    """Sequential requests to a one-worker gateway, SIGKILL, then count the rows that made it."""
    import httpx

    port = free_port()
    command = [*gateway_cmd[:gateway_cmd.index("--port")], "--port", str(port), "--data-dir", str(data_dir),
               "--log-level", "warning", "--workers", "1"]
    process = subprocess.Popen(command, env={**os.environ, "PREFIXGATE_SECRET": "load-secret-0123456789"})
    base = f"http://127.0.0.1:{port}"
    answered: list[float] = []
    try:
        wait_healthy(base, process)
        with httpx.Client(headers={"authorization": "Bearer durable"}, timeout=30) as client:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if client.post(base + "/v1/chat/completions", json=BODY).status_code == 200:
                    answered.append(time.monotonic())
        process.kill()
        killed = time.monotonic()
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    written = sum(count_rows(data_dir / "prefixgate.db").values())
    lost = answered[written:]  # sequential: rows are written in answer order
    return {"flush_interval_s": FLUSH_INTERVAL_S, "answered": len(answered), "rows": written,
            "lost": len(lost), "oldest_lost_answer_age_ms": (killed - lost[0]) * 1000 if lost else None}


def count_rows(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT status, count(*) FROM request_log GROUP BY status").fetchall()
    return {str(status): count for status, count in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run (default 8)")
    parser.add_argument("--workers", type=int, default=None, help="gateway --workers (default: its own default)")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels, comma-separated")
    parser.add_argument("--modes", default="json,stream", help="json, stream or both")
    parser.add_argument("--quick", action="store_true", help="2 s per run (smoke run)")
    parser.add_argument("--output", type=Path, default=RESULTS / "gateway_load.json")
    parser.add_argument("--no-neighbour", dest="neighbour", action="store_false",
                        help="skip the 7.5 MiB noisy-neighbour phase")
    parser.add_argument("--no-sigkill", dest="sigkill", action="store_false", help="skip the SIGKILL phase")
    args = parser.parse_args()
    duration = 2 if args.quick else args.duration
    levels = [int(level) for level in args.levels.split(",")]
    modes = args.modes.split(",")
    wrk = ensure_wrk()
    up_port, gw_port = free_port(), free_port()
    direct_base, gateway_base = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, script = Path(tmp) / "data", Path(tmp) / "load.lua"
        script.write_text(LUA)
        bodies = {mode: Path(tmp) / f"{mode}.json" for mode in modes}
        for mode, path in bodies.items():
            path.write_text(json.dumps({**BODY, "stream": mode == "stream"}))
        gateway_cmd = [sys.executable, "-m", "gateway.cli", "gateway", "--upstream", direct_base,
                       "--port", str(gw_port), "--data-dir", str(data_dir), "--log-level", "warning"]
        if args.workers is not None:
            gateway_cmd += ["--workers", str(args.workers)]
        upstream = subprocess.Popen([sys.executable, str(OVERHEAD), "--serve-upstream", str(up_port)])
        gateway = subprocess.Popen(gateway_cmd, env={**os.environ, "PREFIXGATE_SECRET": "load-secret-0123456789"})
        try:
            wait_healthy(direct_base, upstream)
            wait_healthy(gateway_base, gateway)
            for mode in modes:
                for concurrency in levels:
                    row: dict[str, Any] = {"mode": mode, "concurrency": concurrency}
                    for name, base in (("direct", direct_base), ("gateway", gateway_base)):
                        pid = upstream.pid if name == "direct" else gateway.pid
                        cpu_before = tree_cpu_seconds(pid)
                        row[name] = run_wrk(wrk, base + "/v1/chat/completions", concurrency, duration,
                                            bodies[mode], script)
                        row[name]["cpu_ms_per_request"] = (
                            (tree_cpu_seconds(pid) - cpu_before) * 1000 / max(1, row[name]["requests"]))
                    rows.append(row)
                    print_row(row, flush=True)
            neighbour = noisy_neighbour(gateway_base, 100 if args.quick else 300) if args.neighbour else None
            gateway.send_signal(signal.SIGTERM)
            gateway_rc = gateway.wait(60)
            durability = sigkill_durability(gateway_cmd, Path(tmp) / "killed", 2.0) if args.sigkill else None
        finally:
            for process in (gateway, upstream):
                if process.poll() is None:
                    process.terminate()
                    process.wait(60)
        stats_rows = count_rows(data_dir / "prefixgate.db")
    answered = sum(row["gateway"]["requests"] - row["gateway"]["error_kinds"]["status"] for row in rows)
    answered += neighbour["requests"] if neighbour else 0
    cut_off_at_most = sum(row["concurrency"] for row in rows)
    total_rows = sum(stats_rows.values())
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "duration_s": duration, "workers": args.workers, "runs": rows,
        "stats": {"rows_by_status": stats_rows, "rows": total_rows, "answered_by_wrk": answered,
                  "in_flight_at_wrk_stop_at_most": cut_off_at_most, "gateway_exit_code": gateway_rc,
                  "every_answer_has_a_row": answered <= total_rows <= answered + cut_off_at_most},
        "noisy_neighbour": neighbour, "sigkill": durability,
    }
    print_summary(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


HEADER = (f"{'mode':6} {'conc':>4} | {'direct rps':>10} {'p50':>7} {'p99':>7} {'err':>4} | "
          f"{'gateway rps':>11} {'p50':>7} {'p99':>7} {'err':>4} {'cpu ms/req':>10} | {'ratio':>5}")
_printed_header = False


def print_row(row: dict[str, Any], flush: bool = False) -> None:
    global _printed_header
    if not _printed_header:
        print(HEADER)
        _printed_header = True
    d, g = row["direct"], row["gateway"]
    print(f"{row['mode']:6} {row['concurrency']:4d} | {d['rps']:10.0f} {d['p50_ms']:7.2f} {d['p99_ms']:7.2f} "
          f"{d['errors']:4d} | {g['rps']:11.0f} {g['p50_ms']:7.2f} {g['p99_ms']:7.2f} {g['errors']:4d} "
          f"{g['cpu_ms_per_request']:10.2f} | "
          f"{g['rps'] / d['rps']:5.2f}", flush=flush)


def print_summary(report: dict[str, Any]) -> None:
    print("\n(ms columns are latencies; ratio = gateway rps / direct rps)")
    for mode in sorted({row["mode"] for row in report["runs"]}):
        runs = [row for row in report["runs"] if row["mode"] == mode]
        base = next((row for row in runs if row["concurrency"] == 1), None)
        if base is None:
            continue
        c1 = base["gateway"]["rps"]
        scaling = ", ".join(f"c={row['concurrency']}: {row['gateway']['rps'] / c1:.2f}x" for row in runs)
        added = base["gateway"]["p50_ms"] - base["direct"]["p50_ms"]
        print(f"{mode}: gateway throughput vs its c=1: {scaling}; added p50 at c=1: {added:.2f} ms")
    stats = report["stats"]
    print(f"stats rows: {stats['rows']} ({stats['rows_by_status']}) for {stats['answered_by_wrk']} answers seen by "
          f"wrk (+ at most {stats['in_flight_at_wrk_stop_at_most']} in flight at each stop): "
          f"{'every answer has a row' if stats['every_answer_has_a_row'] else 'ROWS MISSING'}")
    if report["noisy_neighbour"]:
        n = report["noisy_neighbour"]
        bigs = "; ".join("{status} in {ms:.0f} ms [{warning_codes}]".format(**b) for b in n["big_requests"][:3])
        print(f"another tenant while 7.5 MiB dated prompts are checked: p99 {n['idle_p99_ms']:.1f} ms idle -> "
              f"{n['loaded_p99_ms']:.1f} ms ({n['p99_ratio']:.2f}x; p50 {n['idle_p50_ms']:.1f} -> "
              f"{n['loaded_p50_ms']:.1f} ms); {len(n['big_requests'])} big requests: {bigs}")
    if report["sigkill"]:
        k = report["sigkill"]
        age = "n/a" if k["oldest_lost_answer_age_ms"] is None else f"{k['oldest_lost_answer_age_ms']:.0f} ms"
        print(f"SIGKILL: {k['lost']} of {k['answered']} answered rows lost; the oldest lost answer was {age} "
              f"old at the kill (flush interval {k['flush_interval_s'] * 1000:.0f} ms)")
    machine = report["machine"]
    print(f"load average before/after: {machine['load_average_before'][0]:.2f} / "
          f"{machine['load_average_after'][0]:.2f} on {machine['cpus']} cpus")


if __name__ == "__main__":
    sys.exit(main())
