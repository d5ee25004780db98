"""TTFT with and without a cached shared prefix, on the bundled model, and the decode step.

For each shared-prefix length (512, 1k, 2k, 4k tokens) and each run, the prompt
is the prefix followed by a short unique suffix:

* cold: the prompt under a cache salt of its own (nothing is cached under it: a
  full prefill), on the same engine;
* warm: the same prompt on the caching engine, whose cache holds the prefix
  (primed once per length with a different suffix); its K/V are read from the
  block pool through the block table;
* floor: a bare forward over the suffix tokens alone (no cache, stock SDPA
  attention, last-position logits only), the least any warm request can cost;
* llama.cpp cold / warm (``--llama``): the same prompts on llama.cpp's server
  (same bundled GGUF, 2 threads, one slot), one token generated; cold with
  ``cache_prompt: false``, warm after priming the slot with the prefix. The
  figure is the server's own ``timings.prompt_ms`` (prompt processing up to the
  first token), the counterpart of the engine's arrival-to-first-token.

The decode step: one request decoding alone (64-token prompt, 64 tokens, no draft
tokens: one forward per token), the time per generated token after the first, against a bare forward of one token
(no cache, stock SDPA), interleaved run by run.

The kinds are interleaved run by run within one run of this script, and every
measured prompt has its own suffix (a repeated prompt would also hit the block
its suffix filled the first time, and run fewer tokens).

TTFT is the engine's own measurement (arrival to first sampled token). It prints
a table of medians and writes benchmarks/results/ttft.json, including whether
cold and warm greedy outputs were identical and the issue's targets.

Usage: .venv/bin/python benchmarks/ttft.py [--runs 5] [--dtype auto] [--threads N] [--llama] [--weights q4_1]
"""

from __future__ import annotations

import argparse
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
import torch
from servers import llama_server

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "ttft.json"
LOGS = Path(__file__).resolve().parent / "results" / "logs"
LENGTHS = (512, 1024, 2048, 4096)
SUFFIX_TOKENS = 20
OUTPUT_TOKENS = 8


def text_tokens(tokenizer: Any, n: int, seed: int) -> list[int]:
    """``n`` tokens of varied English-like text, different for each seed."""
    words = ["the", "engine", "reuses", "cached", "blocks", "of", "keys", "and", "values", "across", "requests", "so", "a", "long", "shared", "prompt", "is", "computed", "only", "once"]
    parts, i = [], seed
    while True:
        i = (i * 1103515245 + 12345) % 2**31
        parts.append(f"{words[i % len(words)]} {i % 997}")
        if len(parts) % 64 == 0:
            ids = tokenizer.encode(" ".join(parts), add_special_tokens=False)
            if len(ids) >= n:
                return list(ids[:n])


class Timer:
    """Collects the engine's TTFT observations, one request at a time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.last: float | None = None
        engine.add_ttft_observer(self.observe)

    def observe(self, seconds: float) -> None:
        self.last = seconds


def generate(
    engine: LLMEngine, timer: Timer, rid: str, prompt: list[int], max_tokens: int = OUTPUT_TOKENS,
    salt: str | None = None,
) -> tuple[float, list[int], int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    timer.last = None
    outputs = engine.submit(GenerationRequest(rid, prompt, params, cache_salt=salt)).result(timeout=600)
    assert timer.last is not None and outputs[-1].finish_reason == "length", outputs[-1]
    tokens = [t for o in outputs for t in o.new_token_ids]
    return timer.last, tokens, outputs[-1].num_cached_tokens


@torch.inference_mode()
def floor_seconds(model: Any, suffix: list[int]) -> float:
    own = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        ids = torch.tensor([suffix])
        start = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1)
        return time.perf_counter() - start
    finally:
        model.config._attn_implementation = own


def llama_prompt_ms(base: str | None, prompt: list[int], cache: bool) -> float | None:
    """llama.cpp's prompt processing time for ``prompt`` (one token generated)."""
    if base is None:
        return None
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": cache, "temperature": 0.0}
    timings = httpx.post(base + "/completion", json=body, timeout=600).json()["timings"]
    return float(timings["prompt_ms"]) / 1e3


def floor_on_loop(engine: LLMEngine, suffix: list[int]) -> float:
    """:func:`floor_seconds` on the engine's loop thread (its OpenMP pool: see
    :meth:`LLMEngine.launch`)."""
    return engine.call(lambda: floor_seconds(engine.model, suffix))


def bench_length(engine: LLMEngine, timer: Timer, length: int, runs: int, llama: str | None) -> dict[str, Any]:
    tok = engine.tokenizer
    prefix = text_tokens(tok, length, seed=length)
    # Every measured prompt has its own suffix: a repeated prompt would also hit the
    # block its own suffix filled the first time, and run fewer tokens.
    suffixes = [text_tokens(tok, SUFFIX_TOKENS, seed=10_000 + length * 100 + r) for r in range(runs + 1)]
    generate(engine, timer, f"prime-{length}", prefix + suffixes[-1])
    floor_on_loop(engine, suffixes[0])  # warm-up
    llama_prompt_ms(llama, prefix + suffixes[-1], cache=True)
    # The kinds are interleaved run by run, so that load from other processes hits
    # them alike; each measured prompt is used once per engine.
    prompts = [prefix + suffixes[r] for r in range(runs)]
    cold_runs, warm_runs, floor, llama_cold, llama_warm = [], [], [], [], []
    for r in range(runs):
        cold_runs.append(generate(engine, timer, f"cold-{length}-{r}", prompts[r], salt=f"cold-{length}-{r}"))
        warm_runs.append(generate(engine, timer, f"warm-{length}-{r}", prompts[r]))
        floor.append(floor_on_loop(engine, suffixes[r]))
        llama_cold.append(llama_prompt_ms(llama, prompts[r], cache=False))
        llama_prompt_ms(llama, prefix + suffixes[-1], cache=True)  # the slot holds the prefix again
        llama_warm.append(llama_prompt_ms(llama, prompts[r], cache=True))
    cold = [c[0] for c in cold_runs]
    warm = [w[0] for w in warm_runs]
    hits = [w[2] for w in warm_runs]
    identical = [c[1] == w[1] for c, w in zip(cold_runs, warm_runs, strict=True)]
    row: dict[str, Any] = {
        "prefix_tokens": length,
        "prompt_tokens": length + SUFFIX_TOKENS,
        "cached_tokens": statistics.median(hits),
        "cached_tokens_all": hits,
        "cold_ms": statistics.median(cold) * 1e3,
        "warm_ms": statistics.median(warm) * 1e3,
        "floor_ms": statistics.median(floor) * 1e3,
        "identical_greedy_outputs": all(identical),
        "runs": runs,
        "cold_all_ms": [c * 1e3 for c in cold],
        "warm_all_ms": [x * 1e3 for x in warm],
        "floor_all_ms": [x * 1e3 for x in floor],
        "llama_cold_ms": None,
        "llama_warm_ms": None,
    }
    if llama is not None:
        row["llama_cold_ms"] = statistics.median(x for x in llama_cold if x is not None) * 1e3
        row["llama_warm_ms"] = statistics.median(x for x in llama_warm if x is not None) * 1e3
    row["speedup"] = row["cold_ms"] / row["warm_ms"]
    row["warm_over_floor"] = row["warm_ms"] / row["floor_ms"]
    row["hit_cost_ms"] = row["warm_ms"] - row["floor_ms"]
    return row


def bench_decode_step(engine: LLMEngine, timer: Timer, runs: int) -> dict[str, Any]:
    """Per-token decode time of one request running alone vs a bare 1-token forward."""
    tokens = 64
    steps, floor = [], []
    floor_on_loop(engine, [5])
    for r in range(runs):
        prompt = text_tokens(engine.tokenizer, 64, seed=90_000 + r)
        start = time.perf_counter()
        ttft, out, _ = generate(engine, timer, f"decode-{r}", prompt, max_tokens=tokens + 1)
        total = time.perf_counter() - start
        steps.append((total - ttft) / tokens)
        floor.append(statistics.median(floor_on_loop(engine, [out[i]]) for i in range(5)))
    step, bare = statistics.median(steps) * 1e3, statistics.median(floor) * 1e3
    return {"decode_step_ms": step, "bare_1_token_ms": bare, "ratio": step / bare,
            "decode_step_all_ms": [x * 1e3 for x in steps], "bare_all_ms": [x * 1e3 for x in floor]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    parser.add_argument("--llama", action="store_true", help="also measure llama.cpp's server")
    parser.add_argument("--weights", default="dense", choices=("dense", "q4_1"),
                        help="the engines' projections (EngineConfig.weights; default: dense)")
    args = parser.parse_args(argv)

    # no draft tokens: the decode step is one forward per token (speculative decoding,
    # measured by batching.py, would divide it by the drafts kept)
    config = EngineConfig(dtype=args.dtype, kv_cache_memory_gib=1.0, num_threads=args.threads, seed=0,
                          weights=args.weights, speculative_tokens=0)
    # One engine, loaded and run on one thread as `prefixgate engine` runs it: a second
    # engine (or the model called from this thread) would give the process another
    # OpenMP pool, and with more pool threads than cores every parallel region pays a
    # wake-up (LLMEngine.launch). Cold 2k prefill measured that way: 3.6 s; alone: ~2 s.
    cached = LLMEngine.launch(config)
    timer = Timer(cached)
    try:
        if args.llama:
            with llama_server("-np", "1", log=LOGS / "llama-server-ttft.log") as base:
                rows = [bench_length(cached, timer, n, args.runs, base) for n in args.lengths]
        else:
            rows = [bench_length(cached, timer, n, args.runs, None) for n in args.lengths]
        decode = bench_decode_step(cached, timer, args.runs)
    finally:
        cached.shutdown()

    print(f"TTFT, median of {args.runs} runs, dtype={cached.layout.dtype}, threads={torch.get_num_threads()}")
    header = (
        f"{'prefix':>7} {'cached':>7} {'cold ms':>9} {'warm ms':>9} {'floor ms':>9} {'speedup':>8} "
        f"{'warm/floor':>10} {'hit cost ms':>11} {'llama cold':>10} {'llama warm':>10} {'same out':>8}"
    )
    print(header)

    def ms(value: float | None) -> str:
        return f"{value:10.1f}" if value is not None else f"{'-':>10}"

    for r in rows:
        print(
            f"{r['prefix_tokens']:>7} {r['cached_tokens']:>7.0f} {r['cold_ms']:>9.1f} {r['warm_ms']:>9.1f} "
            f"{r['floor_ms']:>9.1f} {r['speedup']:>7.1f}x {r['warm_over_floor']:>9.2f}x "
            f"{r['hit_cost_ms']:>11.1f} {ms(r['llama_cold_ms'])} {ms(r['llama_warm_ms'])} "
            f"{'yes' if r['identical_greedy_outputs'] else 'NO':>8}"
        )
    print(f"decode step alone: {decode['decode_step_ms']:.1f} ms vs bare 1-token forward "
          f"{decode['bare_1_token_ms']:.1f} ms ({decode['ratio']:.2f}x)")
    at_2k = next((r for r in rows if r["prefix_tokens"] == 2048), None)
    targets: dict[str, Any] = {"decode_step_at_most_1_3x_bare": decode["ratio"] <= 1.3}
    if at_2k is not None:
        targets.update({
            "speedup_at_2k_at_least_10x": at_2k["speedup"] >= 10,
            "warm_at_most_1_5x_floor_at_2k": at_2k["warm_over_floor"] <= 1.5,
            "identical_outputs_at_2k": at_2k["identical_greedy_outputs"],
        })
    print("targets:", ", ".join(f"{k}={'met' if v else 'NOT met'}" for k, v in targets.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "ttft",
        "dtype": str(cached.layout.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "suffix_tokens": SUFFIX_TOKENS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "rows": rows,
        "decode_step": decode,
        "targets": targets,
    }, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
