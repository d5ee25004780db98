"""TTFT with and without a cached shared prefix, on the bundled model.

For each shared-prefix length (512, 1k, 2k, 4k tokens) and each run, the prompt
is the prefix followed by a short unique suffix:

* cold: the prompt on an engine with prefix caching disabled (a full prefill);
* warm: the same prompt on the caching engine, whose cache holds the prefix
  (primed once per length with a different suffix). The engine keeps the last
  finished request's working cache as a spare, so consecutive warm requests on
  the same prefix skip the gather from the blocks;
* warm (gather): the same, with the spare dropped first, so the hit's K/V are
  gathered from the block pool (the cost of a hit after unrelated traffic);
* floor: a bare forward over the suffix tokens alone (no cache, stock SDPA
  attention, last-position logits only), the least any warm request can cost.

The kinds are interleaved run by run within one run of this script, and every
measured prompt has its own suffix (a repeated prompt would also hit the block
its suffix filled the first time, and run fewer tokens).

TTFT is the engine's own measurement (arrival to first sampled token). It prints
a table of medians and writes benchmarks/results/ttft.json, including whether
cold and warm greedy outputs were identical and the issue's two targets at 2k.

Usage: .venv/bin/python benchmarks/ttft.py [--runs 5] [--dtype auto] [--threads N]
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

import torch

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "ttft.json"
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


def generate(engine: LLMEngine, timer: Timer, rid: str, prompt: list[int]) -> tuple[float, list[int], int]:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    timer.last = None
    outputs = engine.submit(GenerationRequest(rid, prompt, params)).result(timeout=600)
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


def bench_length(cached: LLMEngine, plain: LLMEngine, timers: dict[str, Timer], length: int, runs: int) -> dict[str, Any]:
    tok = cached.tokenizer
    prefix = text_tokens(tok, length, seed=length)
    # Every measured prompt has its own suffix: a repeated prompt would also hit the
    # block its own suffix filled the first time, and run fewer tokens.
    suffixes = [text_tokens(tok, SUFFIX_TOKENS, seed=10_000 + length * 100 + r) for r in range(2 * runs + 1)]
    generate(cached, timers["cached"], f"prime-{length}", prefix + suffixes[-1])
    floor_seconds(cached.model, suffixes[0])  # warm-up
    # The kinds are interleaved run by run, so that load from other processes hits
    # them alike; each measured prompt is used once per engine.
    warm_prompts = [prefix + suffixes[r] for r in range(runs)]
    gather_prompts = [prefix + suffixes[runs + r] for r in range(runs)]
    cold_runs, warm_runs, gather_runs, floor = [], [], [], []
    for r in range(runs):
        cold_runs.append(generate(plain, timers["plain"], f"cold-{length}-{r}", warm_prompts[r]))
        warm_runs.append(generate(cached, timers["cached"], f"warm-{length}-{r}", warm_prompts[r]))
        cold_runs.append(generate(plain, timers["plain"], f"cold-g-{length}-{r}", gather_prompts[r]))
        cached.runner.drop_spare()  # the engine is idle: nothing else touches the runner
        gather_runs.append(generate(cached, timers["cached"], f"gather-{length}-{r}", gather_prompts[r]))
        floor.append(floor_seconds(cached.model, suffixes[r]))
    cold = [c[0] for c in cold_runs]
    warm = [w[0] for w in warm_runs]
    gather = [g[0] for g in gather_runs]
    hits = [w[2] for w in warm_runs + gather_runs]
    pairs = zip(cold_runs, [run for pair in zip(warm_runs, gather_runs, strict=True) for run in pair], strict=True)
    identical = [c[1] == w[1] for c, w in pairs]
    row = {
        "prefix_tokens": length,
        "prompt_tokens": length + SUFFIX_TOKENS,
        "cached_tokens": statistics.median(hits),
        "cached_tokens_all": hits,
        "cold_ms": statistics.median(cold) * 1e3,
        "warm_ms": statistics.median(warm) * 1e3,
        "warm_gather_ms": statistics.median(gather) * 1e3,
        "floor_ms": statistics.median(floor) * 1e3,
        "identical_greedy_outputs": all(identical),
        "runs": runs,
        "cold_all_ms": [c[0] * 1e3 for c in cold_runs],
        "warm_all_ms": [x * 1e3 for x in warm],
        "warm_gather_all_ms": [x * 1e3 for x in gather],
        "floor_all_ms": [x * 1e3 for x in floor],
    }
    row["speedup"] = row["cold_ms"] / row["warm_ms"]
    row["warm_over_floor"] = row["warm_ms"] / row["floor_ms"]
    row["gather_over_floor"] = row["warm_gather_ms"] / row["floor_ms"]
    row["hit_cost_ms"] = row["warm_ms"] - row["floor_ms"]
    row["gather_hit_cost_ms"] = row["warm_gather_ms"] - row["floor_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    args = parser.parse_args(argv)

    config = EngineConfig(dtype=args.dtype, kv_cache_memory_gib=1.0, num_threads=args.threads, seed=0)
    cached = LLMEngine.from_config(config)
    plain = LLMEngine(cached.model, cached.tokenizer, EngineConfig(
        dtype=args.dtype, kv_cache_memory_gib=0.5, enable_prefix_caching=False, served_model_name="plain"
    ))
    timers = {"cached": Timer(cached), "plain": Timer(plain)}
    cached.start()
    plain.start()
    try:
        rows = [bench_length(cached, plain, timers, n, args.runs) for n in args.lengths]
    finally:
        cached.shutdown()
        plain.shutdown()

    print(f"TTFT, median of {args.runs} runs, dtype={cached.layout.dtype}, threads={torch.get_num_threads()}")
    header = (
        f"{'prefix':>7} {'cached':>7} {'cold ms':>9} {'warm ms':>9} {'gather ms':>10} {'floor ms':>9} "
        f"{'speedup':>8} {'warm/floor':>10} {'gather/floor':>12} {'hit cost ms':>11} {'same out':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['prefix_tokens']:>7} {r['cached_tokens']:>7.0f} {r['cold_ms']:>9.1f} {r['warm_ms']:>9.1f} "
            f"{r['warm_gather_ms']:>10.1f} {r['floor_ms']:>9.1f} {r['speedup']:>7.1f}x "
            f"{r['warm_over_floor']:>9.2f}x {r['gather_over_floor']:>11.2f}x "
            f"{r['hit_cost_ms']:>11.1f} {'yes' if r['identical_greedy_outputs'] else 'NO':>8}"
        )
    at_2k = next((r for r in rows if r["prefix_tokens"] == 2048), None)
    targets = None
    if at_2k is not None:
        targets = {
            "speedup_at_2k_at_least_10x": at_2k["speedup"] >= 10,
            "warm_at_most_1_5x_floor_at_2k": at_2k["warm_over_floor"] <= 1.5,
            "identical_outputs_at_2k": at_2k["identical_greedy_outputs"],
        }
        print("targets at 2k:", ", ".join(f"{k}={'met' if v else 'NOT met'}" for k, v in targets.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "ttft",
        "dtype": str(cached.layout.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "suffix_tokens": SUFFIX_TOKENS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "rows": rows,
        "targets_at_2k": targets,
    }, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
