"""Concurrent streams: prefixgate's engine batched vs one at a time vs llama.cpp's server.

For each server, in one run of this script and one after the other (never two at
once): ``prefixgate engine`` with its default batching, ``prefixgate engine
--max-num-seqs 1`` (one request per forward, the old engine's behaviour), and
llama.cpp's server on the same bundled GGUF (``-np 8``, 2 threads). For each
concurrency level, that many streaming ``/v1/completions`` requests start at once,
each with its own short prompt (token ids, so every server gets the same tokens)
and ``max_tokens`` forced output tokens (``ignore_eos``, greedy). Measured on the
client: output tokens/s over the level's wall time, TTFT (send to first streamed
token) and latency (send to last byte), p50 and p99.

Then the shared-prefix case: 16 requests sharing a 2k-token system prompt (plus a
short unique question each) arriving together, on a server whose cache is cold.

Prints a table and writes benchmarks/results/batching.json with the issue's targets:
8 streams >= 4x ``--max-num-seqs 1`` and >= llama.cpp; 64 streams TTFT p50 <= 1/4
of ``--max-num-seqs 1``.

``--profile`` runs no server: in this process, an engine decodes with each
``--streams`` level of running requests and prints where one decode step's time
goes (projections, LM head, attention, norms, RoPE, sampling, the output hand-off,
the rest; see ``step_profile.py``), writing benchmarks/results/batching_profile.json.

llama.cpp's server runs with ``-np 8`` (8 slots) for levels of up to 8 streams and a
second one with ``-np 16`` for the levels above (a fair peer at 16 streams: with 8
slots half of them would wait).

``nospec`` is the batched engine with ``--speculative-tokens 0`` (no drafts: the
engine's one-token-per-forward decoding); each engine level reports how many draft
tokens it verified and kept (from ``/metrics``). ``bf16dec`` is the batched engine with
``--no-gguf-decode`` (its decode steps read the bfloat16 weights, not the GGUF's 4-bit
blocks: the same outputs, more bytes a step). Every server gets the same
prompts. ``--workload chat`` replaces the 24-token text prompts with chat questions
in the model's template: the text prompts' greedy continuations repeat themselves
(the bundled model loops on them), so drafts are mostly kept, while chat answers
repeat little.

``--rounds N`` repeats the servers in turn N times (batched, seq1, llama, batched,
...; the shared-prefix case only in the first round); the table and the targets
then use each figure's median over the rounds, and the JSON keeps every round and
the 8-stream ratios of each. On a shared machine one round can catch a burst of
other work that the next server does not see; alternating rounds spreads it.

Usage: .venv/bin/python benchmarks/batching.py [--streams 1 4 8 16 64] [--tokens 128]
       [--seq1-streams ...] [--llama-streams ...] [--servers batched seq1 llama]
       [--shared batched seq1 llama] [--engine-threads N] [--rounds N] [--profile]
       [--weights dense|q4_1] [--workload text|chat]
Example: .venv/bin/python benchmarks/batching.py --streams 1 8 --rounds 3
Example: .venv/bin/python benchmarks/batching.py --profile --streams 1 8
Example: .venv/bin/python benchmarks/batching.py --streams 1 8 16 --servers batched nospec llama --workload chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from servers import engine_server, llama_server

RESULTS = Path(__file__).resolve().parent / "results" / "batching.json"
PROFILE_RESULTS = RESULTS.with_name("batching_profile.json")
PROFILE_STEPS = 20
LOGS = Path(__file__).resolve().parent / "results" / "logs"
SHARED_PREFIX_TOKENS = 2048
SHARED_REQUESTS = 16
SHARED_OUTPUT_TOKENS = 16


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.model_store import ensure_converted_model

    return AutoTokenizer.from_pretrained(str(ensure_converted_model()), local_files_only=True)


def text_tokens(tok: Any, n: int, seed: int) -> list[int]:
    """``n`` tokens of varied English-like text, different for each seed."""
    words = ["the", "shop", "repairs", "bikes", "and", "sells", "parts", "for", "city", "riders", "who", "need", "fast", "help"]
    parts, i = [], seed
    while True:
        i = (i * 1103515245 + 12345) % 2**31
        parts.append(f"{words[i % len(words)]} {i % 997}")
        if len(parts) % 32 == 0:
            ids = tok.encode(" ".join(parts), add_special_tokens=False)
            if len(ids) >= n:
                return list(ids[:n])


CHAT_QUESTIONS = [
    "How do I fix a flat bicycle tyre?", "Write a short poem about the sea.", "What is the capital of France?",
    "Explain how a bicycle gear works.", "Give me three tips for commuting by bike in winter.",
    "What should I check before a long ride?", "Summarize the plot of Romeo and Juliet.",
    "How often should I oil my chain?", "Why is the sky blue?", "Write a haiku about autumn.",
    "What is the difference between a road bike and a gravel bike?", "How do I choose a helmet?",
    "Tell me a fun fact about octopuses.", "Explain photosynthesis to a child.",
    "What are the benefits of cycling to work?", "How do I adjust my brakes?",
]


def chat_tokens(tok: Any, seed: int) -> list[int]:
    """A chat request's prompt (the model's template, one user question), chosen by ``seed``."""
    question = CHAT_QUESTIONS[(seed * 7919) % len(CHAT_QUESTIONS)]
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def prompt_tokens(tok: Any, workload: str, seed: int) -> list[int]:
    """A stream's prompt: 24 tokens of English-like text (``text``) or a chat question (``chat``)."""
    return chat_tokens(tok, seed) if workload == "chat" else text_tokens(tok, 24, seed)


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": True,
    }
    start = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    completion = (usage or {}).get("completion_tokens") or chunks
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": (first or end) - start, "latency": end - start, "tokens": completion, "cached": cached}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def level(url: str, model: str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, model, p, tokens) for p in prompts))
        wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    latency = [r["latency"] for r in results]
    total = sum(r["tokens"] for r in results)
    return {
        "streams": len(prompts), "wall_s": wall, "output_tokens": total, "tokens_per_s": total / wall,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "latency_p50_ms": pct(latency, 0.5) * 1e3, "latency_p99_ms": pct(latency, 0.99) * 1e3,
        "cached_tokens": [r["cached"] for r in results],
    }


def spec_counters(base: str) -> tuple[float, float] | None:
    """A prefixgate engine's draft and accepted token counters (speculative decoding),
    None for another server."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        for key in ("spec_decode_draft_tokens_total", "spec_decode_accepted_tokens_total"):
            if line.startswith(f"prefixgate_engine_{key}"):
                found[key] = float(line.rsplit(" ", 1)[1])
    if len(found) != 2:
        return None
    return found["spec_decode_draft_tokens_total"], found["spec_decode_accepted_tokens_total"]


def run_server(
    name: str, base: str, model: str, tok: Any, streams: list[int], tokens: int, seed: int, shared_case: bool,
    workload: str = "text",
) -> dict[str, Any]:
    out: dict[str, Any] = {"levels": [], "load_avg_before": os.getloadavg()}
    asyncio.run(level(base, model, [text_tokens(tok, 24, seed)], 8))  # warm-up
    for n in streams:
        prompts = [prompt_tokens(tok, workload, seed + 1000 * n + i) for i in range(n)]
        before = spec_counters(base)
        row = asyncio.run(level(base, model, prompts, tokens))
        after = spec_counters(base)
        spec = ""
        if before is not None and after is not None:
            row["draft_tokens"], row["accepted_tokens"] = after[0] - before[0], after[1] - before[1]
            spec = f", drafts kept {row['accepted_tokens']:.0f}/{row['draft_tokens']:.0f}"
        print(f"  {name:>8} {n:>3} streams: {row['tokens_per_s']:7.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:8.0f} ms "
              f"p99 {row['ttft_p99_ms']:8.0f} ms, latency p50 {row['latency_p50_ms']:8.0f} ms, "
              f"load {os.getloadavg()[0]:.1f}{spec}", flush=True)
        out["levels"].append(row)
    out["load_avg_after"] = os.getloadavg()
    if not shared_case:
        return out
    system = text_tokens(tok, SHARED_PREFIX_TOKENS, seed + 7)
    prompts = [system + text_tokens(tok, 16, seed + 50_000 + i) for i in range(SHARED_REQUESTS)]
    shared = asyncio.run(level(base, model, prompts, SHARED_OUTPUT_TOKENS))
    print(f"  {name:>8} shared 2k prefix x{SHARED_REQUESTS}: TTFT p50 {shared['ttft_p50_ms']:.0f} ms "
          f"p99 {shared['ttft_p99_ms']:.0f} ms, latency p50 {shared['latency_p50_ms']:.0f} ms, "
          f"cached {shared['cached_tokens']}", flush=True)
    out["shared_prefix"] = shared
    out["load_avg_after"] = os.getloadavg()
    return out


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server and level, the median over ``rounds`` of every figure (one round: itself)."""
    if len(rounds) == 1:
        return rounds[0]
    out: dict[str, Any] = {}
    for name, first in rounds[0].items():
        levels = []
        for row in first["levels"]:
            same = [next(x for x in r[name]["levels"] if x["streams"] == row["streams"]) for r in rounds]
            merged = dict(row)
            for key, value in row.items():
                if isinstance(value, float) and key != "streams":
                    merged[key] = statistics.median(x[key] for x in same)
            levels.append(merged)
        out[name] = {**first, "levels": levels}
    return out


def profile(tok: Any, streams: list[int], threads: int | None, weights: str) -> int:
    from step_profile import profile_decode, show

    rows = []
    for n in streams:
        prompts = [text_tokens(tok, 24, 17 + 1000 * n + i) for i in range(n)]
        row = profile_decode(n, PROFILE_STEPS, prompts, threads, weights)
        row["load_avg_after"] = os.getloadavg()
        print(show(row), flush=True)
        rows.append(row)
    PROFILE_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    PROFILE_RESULTS.write_text(json.dumps({
        "benchmark": "batching_profile", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "engine_threads": threads, "weights": weights, "levels": rows,
    }, indent=2))
    print(f"wrote {PROFILE_RESULTS}")
    return 0


def _show(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.2f}"
    if isinstance(value, list):
        return f"{key}=[{', '.join(f'{v:.2f}' for v in value)}]"
    return f"{key}={value}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--seq1-streams", type=int, nargs="+", default=None,
                        help="levels for --max-num-seqs 1 (default: --streams)")
    parser.add_argument("--llama-streams", type=int, nargs="+", default=None,
                        help="levels for llama.cpp's server (default: --streams)")
    parser.add_argument("--shared", nargs="*", default=["batched", "seq1", "llama"],
                        help="servers that also run the shared-prefix case (default: all)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--speculative-tokens", type=int, default=None, metavar="N",
                        help="--speculative-tokens of the batched engine (default: the engine's)")
    parser.add_argument("--workload", choices=["text", "chat"], default="text",
                        help="the streams' prompts: 24 tokens of English-like text, whose greedy continuation "
                        "by the bundled model repeats itself (drafts are often kept), or chat questions in the "
                        "model's template (they rarely are) (default: text)")
    parser.add_argument("--engine-threads", type=int, default=None, metavar="N",
                        help="--threads for both prefixgate engines (default: torch's, one per core)")
    parser.add_argument("--servers", nargs="+", default=["batched", "seq1", "llama"],
                        choices=["batched", "nospec", "bf16dec", "seq1", "llama"],
                        help="nospec: the batched engine with --speculative-tokens 0; bf16dec: with "
                        "--no-gguf-decode (default: batched seq1 llama)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the servers in turn this many times; figures are medians (default: 1)")
    parser.add_argument("--weights", choices=["dense", "q4_1"], default="dense",
                        help="--weights of both prefixgate engines and of --profile (default: dense)")
    parser.add_argument("--profile", action="store_true",
                        help="no servers: where one decode step's time goes, per --streams level, in process")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    tok = tokenizer()
    if args.profile:
        return profile(tok, args.streams, args.engine_threads, args.weights)
    model = "SmolLM2-135M-Instruct"
    flags = [] if args.engine_threads is None else ["--threads", str(args.engine_threads)]
    flags += ["--weights", args.weights]
    spec = [] if args.speculative_tokens is None else ["--speculative-tokens", str(args.speculative_tokens)]
    servers = {
        "batched": lambda: engine_server(*flags, *spec, log=LOGS / "engine-batched.log"),
        "nospec": lambda: engine_server("--speculative-tokens", "0", *flags, log=LOGS / "engine-nospec.log"),
        "bf16dec": lambda: engine_server("--no-gguf-decode", *flags, log=LOGS / "engine-bf16dec.log"),
        "seq1": lambda: engine_server("--max-num-seqs", "1", *flags, log=LOGS / "engine-seq1.log"),
        "llama": lambda: llama_server("-np", "8", "-c", "32768", log=LOGS / "llama-server.log"),
        "llama16": lambda: llama_server("-np", "16", "-c", "32768", log=LOGS / "llama-server-np16.log"),
    }
    rounds: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        this: dict[str, Any] = {}
        for name in args.servers:
            streams = {"seq1": args.seq1_streams, "llama": args.llama_streams}.get(name) or args.streams
            print(f"{name}: starting" + (f" (round {round_no + 1} of {args.rounds})" if args.rounds > 1 else ""), flush=True)
            shared = name in args.shared and round_no == 0
            if name == "llama" and any(n > 8 for n in streams):  # a fair peer: 16 slots for > 8 streams
                small, large = [n for n in streams if n <= 8], [n for n in streams if n > 8]
                parts = []
                for key, levels, with_shared in (("llama", small, shared), ("llama16", large, False)):
                    if levels:
                        with servers[key]() as base:
                            parts.append(run_server(key, base, model, tok, levels, args.tokens, 17, with_shared,
                                                   args.workload))
                this[name] = {**parts[0], "levels": [row for part in parts for row in part["levels"]]}
                continue
            with servers[name]() as base:
                this[name] = run_server(name, base, model, tok, streams, args.tokens, 17, shared, args.workload)
        rounds.append(this)
    results = medians(rounds)

    def find(name: str, n: int) -> dict[str, Any] | None:
        rows = results.get(name, {}).get("levels", [])
        return next((r for r in rows if r["streams"] == n), None)

    print(f"\n{args.tokens} output tokens per stream; output tokens/s | TTFT p50/p99 ms | latency p50/p99 ms")
    print(f"{'streams':>7} " + " ".join(f"{n:>44}" for n in results))
    for n in sorted({r["streams"] for v in results.values() for r in v["levels"]}):
        cells = []
        for name in results:
            r = find(name, n)
            cells.append(f"{r['tokens_per_s']:8.1f} | {r['ttft_p50_ms']:6.0f}/{r['ttft_p99_ms']:6.0f} | "
                         f"{r['latency_p50_ms']:6.0f}/{r['latency_p99_ms']:6.0f}" if r else f"{'-':>44}")
        print(f"{n:>7} " + " ".join(f"{c:>44}" for c in cells))
    targets: dict[str, Any] = {}
    b8, s8, l8 = find("batched", 8), find("seq1", 8), find("llama", 8)
    if b8 and s8:
        targets["8_streams_vs_seq1"] = b8["tokens_per_s"] / s8["tokens_per_s"]
        targets["8_streams_at_least_4x_seq1"] = targets["8_streams_vs_seq1"] >= 4
    if b8 and l8:
        targets["8_streams_vs_llama"] = b8["tokens_per_s"] / l8["tokens_per_s"]
        targets["8_streams_at_least_llama"] = targets["8_streams_vs_llama"] >= 1
    b64, s64 = find("batched", 64), find("seq1", 64)
    for n in (1, 8, 16):
        ours, peer, plain, bf16 = find("batched", n), find("llama", n), find("nospec", n), find("bf16dec", n)
        if ours and peer:
            targets[f"{n}_streams_vs_llama"] = ours["tokens_per_s"] / peer["tokens_per_s"]
        if ours and plain:
            targets[f"{n}_streams_vs_nospec"] = ours["tokens_per_s"] / plain["tokens_per_s"]
        if ours and bf16:
            targets[f"{n}_streams_vs_bf16dec"] = ours["tokens_per_s"] / bf16["tokens_per_s"]
    if b64 and s64:
        targets["64_streams_ttft_p50_ratio"] = b64["ttft_p50_ms"] / s64["ttft_p50_ms"]
        targets["64_streams_ttft_p50_at_most_quarter"] = targets["64_streams_ttft_p50_ratio"] <= 0.25
    if args.rounds > 1 and "batched" in results:
        per_round = []
        for this in rounds:
            ours = next((x for x in this["batched"]["levels"] if x["streams"] == 8), None)
            peer = next((x for x in this.get("llama", {}).get("levels", []) if x["streams"] == 8), None)
            if ours and peer:
                per_round.append(ours["tokens_per_s"] / peer["tokens_per_s"])
        if per_round:
            targets["8_streams_vs_llama_per_round"] = per_round
    print("targets:", ", ".join(_show(k, v) for k, v in targets.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "batching", "output_tokens": args.tokens, "workload": args.workload,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg()},
        "engine_threads": args.engine_threads, "weights": args.weights, "rounds": args.rounds, "servers": results, "targets": targets,
        "per_round": rounds if args.rounds > 1 else None,
    }, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
