"""A forward's time by context and chunk size, against the scheduler's cost model.

The scheduler cuts prefill chunks by :func:`engine.core.scheduler.chunk_cost` (in
tokens at short context: ``max(1, c / CONTEXT_COST_TOKENS)`` per token, and a
sequence past ``CONTEXT_COST_TOKENS`` of context ``(c - CONTEXT_COST_TOKENS) /
SEQUENCE_COST_TOKENS`` more for reading its K/V). This measures what those constants
stand for: one sequence's forward of ``n`` new tokens after ``ctx`` cached ones
(``ModelRunner.execute`` on the engine's loop thread through ``LLMEngine.call``, so
torch's threads are the engine's), median and minimum of ``--reps``, for the
(ctx, n) pairs below. Printed per pair: the measured time, the time the model
predicts (the forward's fixed part, the ``ctx=0, n=1`` forward, plus ``chunk_cost``
times the marginal time of a short-context token, fitted from ``n=64`` and ``n=512``
at ``ctx=0``), and the implied cost per token past the forward's fixed part.
Compare on a quiet machine; the load average is printed before and after.

Usage: .venv/bin/python benchmarks/forward_costs.py [--threads N] [--reps 5] [--max-context 7500] [--mirror]
Example: .venv/bin/python benchmarks/forward_costs.py --reps 5
Writes benchmarks/results/forward_costs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import CONTEXT_COST_TOKENS, SEQUENCE_COST_TOKENS, chunk_cost
from engine.model.runner import SequenceInput

RESULTS = Path(__file__).resolve().parent / "results" / "forward_costs.json"
CHUNKS = (1, 8, 16, 32, 64, 128)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=5, help="forwards per (context, chunk) pair (default: 5)")
    parser.add_argument("--max-context", type=int, default=7500, help="the longest cached context (default: 7500)")
    parser.add_argument("--mirror", action="store_true",
                        help="read the sequence's K/V from a KV mirror (engine/model/kv_mirror.py), as the engine "
                        "does for a long exact request, instead of gathering them each forward")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.max_context < 1024:
        parser.error("--reps must be >= 1 and --max-context >= 1024")
    engine = LLMEngine.launch(EngineConfig(kv_cache_memory_gib=0.5, seed=0, num_threads=args.threads,
                                           max_model_len=args.max_context + 1024))
    rng = random.Random(0)
    mirror = "forward-costs" if args.mirror else None
    block_size = engine.kv_cache_manager.block_size
    blocks = list(range(-(-(args.max_context + 1024) // block_size)))
    if len(blocks) > engine.storage.num_blocks:
        parser.error(f"--max-context {args.max_context} needs {len(blocks)} blocks, the pool has "
                     f"{engine.storage.num_blocks}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    def forward(ctx: int, n: int) -> tuple[float, float]:
        times = []
        for _ in range(args.reps):
            tokens = ids(n)
            start = time.perf_counter()
            engine.call(lambda t=tokens: engine.runner.execute([SequenceInput(t, ctx, blocks, True, mirror=mirror)]))
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3, min(times) * 1e3

    load_before = os.getloadavg()[0]
    threads = engine.call(torch.get_num_threads)
    try:
        for start in range(0, args.max_context, 512):  # K/V for every cached position
            engine.call(lambda s=start: engine.runner.execute([SequenceInput(ids(512), s, blocks, True)]))
        contexts = [0, 1024, 2048, 4096, args.max_context]
        pairs = [(0, n) for n in (*CHUNKS, 256, 512)] + [(c, n) for c in contexts[1:] for n in CHUNKS]
        measured = {pair: forward(*pair) for pair in pairs}
    finally:
        engine.shutdown()
    fixed = measured[(0, 1)][0]
    per_token = (measured[(0, 512)][0] - measured[(0, 64)][0]) / (512 - 64)
    rows = []
    print(f"threads={threads} reps={args.reps} load before {load_before:.2f} after {os.getloadavg()[0]:.2f}; "
          f"fixed {fixed:.1f} ms, a short-context token {per_token:.2f} ms; model: CONTEXT_COST_TOKENS="
          f"{CONTEXT_COST_TOKENS}, SEQUENCE_COST_TOKENS={SEQUENCE_COST_TOKENS}")
    print(f"{'context':>8} {'n':>5} {'median ms':>10} {'min ms':>8} {'model ms':>9} {'cost/token':>11} "
          f"{'measured/token':>15}")
    for (ctx, n), (median, low) in measured.items():
        cost = chunk_cost(ctx, n, CONTEXT_COST_TOKENS, SEQUENCE_COST_TOKENS)
        model = fixed + cost * per_token
        implied = (median - fixed) / per_token / n  # short-token equivalents per new token
        rows.append({"context": ctx, "n": n, "median_ms": median, "min_ms": low, "model_ms": model,
                     "cost_per_token": cost / n, "measured_per_token": implied})
        print(f"{ctx:>8} {n:>5} {median:>10.1f} {low:>8.1f} {model:>9.1f} {cost / n:>11.2f} {implied:>15.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "forward_costs", "threads": threads, "mirror": args.mirror, "reps": args.reps,
                                   "load_before": load_before, "load_after": os.getloadavg()[0],
                                   "fixed_ms": fixed, "short_token_ms": per_token,
                                   "context_cost_tokens": CONTEXT_COST_TOKENS,
                                   "sequence_cost_tokens": SEQUENCE_COST_TOKENS, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
